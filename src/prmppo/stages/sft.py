"""Stage `sft`: supervised warm-start of the policy on the task's worked solutions.

    python -m prmppo stage=sft                      # embedded default: tiny model, arith task
    python -m prmppo stage=sft sft.steps=3000       # longer
    python -m prmppo stage=sft model=hf model.path=/ckpt/mistral-7b sft.steps=0   # accept as is

Implements next-token cross-entropy on response tokens only (prompt tokens are context, not
targets), AdamW with a warmup-cosine schedule, batches drawn uniformly with replacement from
the `sft` split with a seeded generator. Simplifications: one device, no packing (rows are
right-padded to the batch's longest), no gradient accumulation (the tiny model fits).
At the end it scores greedy accuracy on the `test` split (the RL prompt distribution) and on
held-out SFT-distribution problems, and saves an HF-layout checkpoint that later stages load.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from omegaconf import DictConfig

from prmppo import artifacts
from prmppo.config.build import build
from prmppo.errors import PrmppoError
from prmppo.evaluation import score
from prmppo.logger.console import log_milestone, progress as progress_bar
from prmppo.models.loading import load_model, load_tokenizer
from prmppo.ppo.maths import make_scheduler
from prmppo.stages.common import open_metrics, train_device, write_stage_result

log = logging.getLogger("prmppo")

IGNORE = -100  # label of positions that carry no loss (prompt and padding)


@dataclass
class SFTBatchSource:
    """All SFT examples tokenized once and right-padded: `input_ids`/`labels` [N, L], `lengths` [N]."""

    input_ids: torch.Tensor  # [N, L]
    labels: torch.Tensor  # [N, L], IGNORE on prompt and padding
    lengths: torch.Tensor  # [N] real tokens per row

    @classmethod
    def build(cls, task, problems, tokenizer, max_length: int) -> "SFTBatchSource":
        rows, labels = [], []
        for problem in problems:
            prompt = tokenizer(task.format_prompt(problem))["input_ids"]
            response = tokenizer(problem.solution, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
            rows.append(prompt + response)
            labels.append([IGNORE] * len(prompt) + response)
        too_long = sum(len(ids) > max_length for ids in rows)
        if too_long:
            raise PrmppoError(
                f"{too_long} of {len(rows)} SFT examples exceed the model's max_position_embeddings={max_length} "
                f"(the longest has {max(map(len, rows))} tokens); raise model.max_position_embeddings (model=tiny) "
                "or use shorter problems")
        longest = max(map(len, rows))
        input_ids = torch.full((len(rows), longest), tokenizer.pad_token_id, dtype=torch.long)
        label_tensor = torch.full((len(rows), longest), IGNORE, dtype=torch.long)
        for i, (ids, lab) in enumerate(zip(rows, labels)):
            input_ids[i, : len(ids)] = torch.tensor(ids)
            label_tensor[i, : len(lab)] = torch.tensor(lab)
        return cls(input_ids, label_tensor, torch.tensor([len(r) for r in rows]))

    def sample(self, batch_rows: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        idx = torch.randint(len(self.lengths), (batch_rows,), generator=generator)
        width = int(self.lengths[idx].max())  # trim the shared padding to this batch's longest row
        return self.input_ids[idx, :width], self.labels[idx, :width]


def response_loss(model, input_ids: torch.Tensor, labels: torch.Tensor, pad_token_id: int) -> torch.Tensor:
    """Mean next-token cross-entropy over response tokens. input_ids, labels: [B, L]."""
    attention_mask = (labels != IGNORE) | (input_ids != pad_token_id)
    logits = model(input_ids=input_ids, attention_mask=attention_mask.long()).logits  # [B, L, V]
    # position t predicts token t+1
    return F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(), ignore_index=IGNORE)


def train_sft(model, source: SFTBatchSource, *, steps: int, batch_rows: int, lr: float, warmup_steps: int,
              min_lr_ratio: float, weight_decay: float, grad_clip: float, pad_token_id: int,
              device: torch.device, seed: int, logger, log_every: int = 25) -> dict:
    """Run `steps` optimizer steps; log loss / lr / tokens per second; return summary stats."""
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay, betas=(0.9, 0.95))
    scheduler = make_scheduler(optimizer, total_steps=steps, warmup_steps=warmup_steps, min_ratio=min_lr_ratio)
    generator = torch.Generator().manual_seed(seed)
    start, tokens, loss_ema = time.time(), 0, None
    progress = progress_bar(range(steps), desc="sft", unit="step", enabled=logger.console)
    for step in progress:
        input_ids, labels = source.sample(batch_rows, generator)
        input_ids, labels = input_ids.to(device), labels.to(device)
        loss = response_loss(model, input_ids, labels, pad_token_id)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
        optimizer.step()
        scheduler.step()
        tokens += int((labels != IGNORE).sum())
        loss_value = loss.item()
        loss_ema = loss_value if loss_ema is None else 0.9 * loss_ema + 0.1 * loss_value
        log_milestone("sft", step, steps, {"loss": loss_ema}, logger.console)
        if step % log_every == 0 or step == steps - 1:
            elapsed = time.time() - start
            logger.log(step, {"sft/loss": loss_value, "sft/lr": scheduler.get_last_lr()[0],
                              "sft/grad_norm": float(grad_norm), "perf/tokens_per_s": tokens / max(elapsed, 1e-9)})
            progress.set_postfix(loss=f"{loss_ema:.3f}")
    model.eval()
    return {"final_loss_ema": loss_ema, "train_seconds": time.time() - start, "response_tokens": tokens}


# --------------------------------------------------------------------------- the stage


def _greedy(model, tokenizer, task, problems, cfg: DictConfig) -> dict:
    return score(model, tokenizer, task, problems, k=0, temperature=cfg.eval.temperature,
                 max_new_tokens=cfg.sft.max_new_tokens, batch_rows=cfg.eval.batch_rows, seed=cfg.seed,
                 show_progress=cfg.logger.console)


def ensure_sft(cfg: DictConfig, task, run_dir: Path, reuse: bool) -> tuple[Path, dict]:
    """The SFT checkpoint for this config, built under its artifact lock (parallel runs that need the
    same one wait for the first to build it, then reuse it); see `_ensure_sft_locked`."""
    with artifacts.building(artifacts.artifact_dir(cfg, "sft")):
        return _ensure_sft_locked(cfg, task, run_dir, reuse)


def _ensure_sft_locked(cfg: DictConfig, task, run_dir: Path, reuse: bool) -> tuple[Path, dict]:
    """The SFT checkpoint for this config: reused when `reuse` and it exists, else trained."""
    final = artifacts.artifact_dir(cfg, "sft")
    if reuse and artifacts.artifact_ready(final):
        log.info("reusing SFT checkpoint %s (same task/model/sft config)", final)
        return final, {"reused": True, "checkpoint": str(final)}
    source = build(cfg.model, "model source")
    init_dir = source.materialize(task, run_dir / "init_model")
    device = train_device(cfg)
    tokenizer = load_tokenizer(init_dir)
    model = load_model(init_dir, cfg.model.dtype, device)
    summary: dict = {"checkpoint": str(final), "init": str(init_dir),
                     "parameters": sum(p.numel() for p in model.parameters())}
    with open_metrics(cfg, run_dir, "sft") as logger:
        if cfg.sft.steps > 0:
            batches = SFTBatchSource.build(task, task.problems("sft"), tokenizer,
                                           model.config.max_position_embeddings)
            summary.update(train_sft(
                model, batches, steps=cfg.sft.steps, batch_rows=cfg.sft.batch_rows, lr=cfg.sft.lr,
                warmup_steps=cfg.sft.warmup_steps, min_lr_ratio=cfg.sft.min_lr_ratio,
                weight_decay=cfg.sft.weight_decay, grad_clip=cfg.sft.grad_clip,
                pad_token_id=tokenizer.pad_token_id, device=device, seed=cfg.seed, logger=logger))
        if cfg.sft.eval_problems > 0:
            start = time.time()
            summary["test"] = _greedy(model, tokenizer, task, task.problems("test")[: cfg.sft.eval_problems], cfg)
            summary["sft_distribution"] = _greedy(model, tokenizer, task,
                                                  task.problems("sft")[-cfg.sft.eval_problems:], cfg)
            summary["eval_seconds"] = time.time() - start
            logger.log(cfg.sft.steps, {"eval/test_greedy_accuracy": summary["test"]["greedy_accuracy"],
                                       "eval/sft_greedy_accuracy": summary["sft_distribution"]["greedy_accuracy"]},
                       echo=True)
    tmp = artifacts.staging_dir(final)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    artifacts.publish(tmp, final, cfg, "sft", summary)
    return final, summary


def run(cfg: DictConfig, run_dir: Path) -> dict:
    """Stage `sft`: a freshly trained SFT checkpoint (published as this config's artifact)."""
    start = time.time()
    task = build(cfg.task, "task")
    _, summary = ensure_sft(cfg, task, run_dir, reuse=False)
    summary["wall_seconds"] = time.time() - start
    write_stage_result(run_dir, cfg, "sft", summary)
    return summary
