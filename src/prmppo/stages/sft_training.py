"""The SFT checkpoint every later stage starts from: supervised warm-start of the policy on the task's
worked solutions (`ensure_sft`, reused when it exists; the `sft` stage itself is `stages/sft.py`).

Implements next-token cross-entropy on response tokens only (prompt tokens are context, not
targets), AdamW with a warmup-cosine schedule, batches drawn uniformly with replacement from
the `sft` split with a seeded generator. Simplifications: no packing (rows are right-padded to
the batch's longest), no gradient accumulation (the tiny model fits).
At the end it scores greedy accuracy on the `test` split (the RL prompt distribution) and on
held-out SFT-distribution problems, and saves an HF-layout checkpoint that later stages load.
With `sft.steps=0` on a directory that outlives the run (`model=hf`), the checkpoint is that directory:
the artifact keeps no copy of its weights, only a reference to it (`models/loading.py MODEL_REFERENCE`,
checked against the directory's files whenever it is read), and `ensure_sft` returns the directory itself.

Several ranks (`topology=fsdp`, `distributed/`): data parallel over the ranks with the model sharded by
FSDP2 (fp32 weights, per decoder block and at the root, computing in `model.dtype`). Every rank
draws the same `sft.batch_rows` rows from the same seeded generator and trains on its own
`batch_rows / N` of them; the loss is the summed cross-entropy over the global count of response
tokens (all-reduced), and FSDP sums the gradients, so a step of N ranks is the one-process step up
to float summation order; gradients are clipped on their global norm. The evaluation runs on every
rank through the sharded model, as PPO's canary does (same problems and seeds, so every rank
generates the same tokens and FSDP's all-gathers meet); rank 0 records it. Rank 0 alone holds the
artifact's build lock, gathers the full weights into a plain copy and publishes the HF-layout
checkpoint (in `model.dtype`); the other ranks wait on a barrier (`stages/common.py make_or_reuse`).
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from omegaconf import DictConfig

from prmppo.config.build import build
from prmppo.distributed.ranks import OneProcess
from prmppo.distributed.shard import clip_global_norm
from prmppo.errors import PrmppoError
from prmppo.evaluation import score
from prmppo.logger.console import log_milestone, progress as progress_bar
from prmppo.models.loading import DTYPES, load_tokenizer, resolve_model_dir, write_model_reference
from prmppo.ppo.maths import make_scheduler
from prmppo.stages.common import Made, make_or_reuse, open_metrics, train_device

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

    def sample(self, batch_rows: int, generator: torch.Generator, rank: int = 0,
               world_size: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
        """`batch_rows` rows drawn with replacement; of them, the `rank`-th of `world_size` equal slices (every
        rank draws the same rows from its own copy of the same generator). [batch_rows / world_size, L]"""
        idx = torch.randint(len(self.lengths), (batch_rows,), generator=generator)
        idx = idx.view(world_size, -1)[rank]  # validate.py: batch_rows divides by world_size
        width = int(self.lengths[idx].max())  # trim the shared padding to these rows' longest
        return self.input_ids[idx, :width], self.labels[idx, :width]


def response_loss_sum(model, input_ids: torch.Tensor, labels: torch.Tensor, pad_token_id: int) -> torch.Tensor:
    """Summed next-token cross-entropy over response tokens. input_ids, labels: [B, L]."""
    attention_mask = (labels != IGNORE) | (input_ids != pad_token_id)
    logits = model(input_ids=input_ids, attention_mask=attention_mask.long()).logits  # [B, L, V]
    # position t predicts token t+1
    return F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(), ignore_index=IGNORE,
                           reduction="sum")


def response_loss(model, input_ids: torch.Tensor, labels: torch.Tensor, pad_token_id: int) -> torch.Tensor:
    """Mean next-token cross-entropy over response tokens. input_ids, labels: [B, L]."""
    return response_loss_sum(model, input_ids, labels, pad_token_id) / (labels[:, 1:] != IGNORE).sum()


def train_sft(model, source: SFTBatchSource, *, steps: int, batch_rows: int, lr: float, warmup_steps: int,
              min_lr_ratio: float, weight_decay: float, grad_clip: float, pad_token_id: int,
              device: torch.device, seed: int, logger, ranks=None, log_every: int = 25) -> dict:
    """Run `steps` optimizer steps; log loss / lr / tokens per second; return summary stats. `ranks`: one
    process when None; under `topology=fsdp` each rank trains on its share of every batch (module docstring)."""
    ranks = ranks if ranks is not None else OneProcess(device)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay, betas=(0.9, 0.95))
    scheduler = make_scheduler(optimizer, total_steps=steps, warmup_steps=warmup_steps, min_ratio=min_lr_ratio)
    generator = torch.Generator().manual_seed(seed)
    start, tokens, loss_ema = time.time(), 0, None
    progress = progress_bar(range(steps), desc="sft", unit="step", enabled=logger.console)
    for step in progress:
        input_ids, labels = source.sample(batch_rows, generator, ranks.rank, ranks.world_size)
        input_ids, labels = input_ids.to(device), labels.to(device)
        # the denominator is the batch's response tokens over every rank: each rank's loss is its share of the mean
        step_tokens = ranks.sum_floats({"tokens": float((labels[:, 1:] != IGNORE).sum())})["tokens"]
        loss = response_loss_sum(model, input_ids, labels, pad_token_id) / step_tokens
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = clip_global_norm(list(model.parameters()), grad_clip)
        optimizer.step()
        scheduler.step()
        tokens += int(step_tokens)
        loss_value = ranks.sum_floats({"loss": loss.item()})["loss"]
        loss_ema = loss_value if loss_ema is None else 0.9 * loss_ema + 0.1 * loss_value
        log_milestone("sft", step, steps, {"loss": loss_ema}, logger.console)
        if step % log_every == 0 or step == steps - 1:
            elapsed = time.time() - start
            logger.log(step, {"sft/loss": loss_value, "sft/lr": scheduler.get_last_lr()[0],
                              "sft/grad_norm": ranks.scalar(grad_norm),
                              "perf/tokens_per_s": tokens / max(elapsed, 1e-9)})
            progress.set_postfix(loss=f"{loss_ema:.3f}")
    model.eval()
    return {"final_loss_ema": loss_ema, "train_seconds": time.time() - start, "response_tokens": tokens}


# --------------------------------------------------------------------------- the stage


def _greedy(model, tokenizer, task, problems, cfg: DictConfig, show_progress: bool) -> dict:
    return score(model, tokenizer, task, problems, k=0, temperature=cfg.eval.temperature,
                 max_new_tokens=cfg.sft.max_new_tokens, batch_rows=cfg.eval.batch_rows, seed=cfg.seed,
                 show_progress=show_progress)


def ensure_sft(cfg: DictConfig, task, run_dir: Path, reuse: bool, ranks=None) -> tuple[Path, dict]:
    """The directory of this config's SFT weights and its summary: the artifact, reused when `reuse` and it
    exists, else trained and published (`make_or_reuse`: under the artifact's build lock, so parallel runs that
    need the same one wait for the first to build it); or, for an artifact that refers to the given model's
    directory (`sft.steps=0`), that directory once checked unchanged. `ranks`: one process when None; under
    `topology=fsdp` every rank calls this."""
    ranks = ranks if ranks is not None else OneProcess(train_device(cfg))
    final, summary = make_or_reuse(cfg, "sft", ranks, lambda out: _train(cfg, task, run_dir, ranks, out), reuse)
    return resolve_model_dir(final), summary


def _train(cfg: DictConfig, task, run_dir: Path, ranks, final: Path) -> Made:
    """The SFT policy trained on every rank (sharded under several ranks), evaluated, ready to publish."""
    source = build(cfg.model, "model source")
    init_dir = ranks.main_first(lambda: source.materialize(task, run_dir / "init_model"))  # rank 0 writes it
    tokenizer = load_tokenizer(init_dir)
    model = ranks.load_for_training(init_dir, cfg.model.dtype)
    summary: dict = {"checkpoint": str(final), "init": str(init_dir),
                     "parameters": sum(p.numel() for p in model.parameters())}
    full = ranks.shard(model, DTYPES[cfg.model.dtype])
    with ranks.main_metrics(lambda: open_metrics(cfg, run_dir, "sft")) as logger:
        if cfg.sft.steps > 0:
            batches = SFTBatchSource.build(task, task.problems("sft"), tokenizer,
                                           model.config.max_position_embeddings)
            summary.update(train_sft(
                model, batches, steps=cfg.sft.steps, batch_rows=cfg.sft.batch_rows, lr=cfg.sft.lr,
                warmup_steps=cfg.sft.warmup_steps, min_lr_ratio=cfg.sft.min_lr_ratio,
                weight_decay=cfg.sft.weight_decay, grad_clip=cfg.sft.grad_clip,
                pad_token_id=tokenizer.pad_token_id, device=ranks.device, seed=cfg.seed, logger=logger,
                ranks=ranks))
        if cfg.sft.eval_problems > 0:
            summary.update(_evaluate(cfg, task, tokenizer, model, logger))

    if cfg.sft.steps == 0 and source.lasting_weights:  # accepted as it is: refer to it, copy nothing
        summary["weights"] = str(init_dir.resolve())
        return Made(summary, lambda _, tmp: write_model_reference(init_dir, tmp))

    def save(trained, tmp: Path) -> None:
        trained.to(DTYPES[cfg.model.dtype]).save_pretrained(tmp)  # N ranks: the fp32 masters in model.dtype
        tokenizer.save_pretrained(tmp)

    return Made(summary, save, full)


def _evaluate(cfg: DictConfig, task, tokenizer, model, logger) -> dict:
    """Greedy accuracy on the first `sft.eval_problems` test problems and the last ones of the sft split
    (on every rank; `logger` is rank 0's)."""
    start, n = time.time(), cfg.sft.eval_problems
    result = {"test": _greedy(model, tokenizer, task, task.problems("test")[:n], cfg, logger.console),
              "sft_distribution": _greedy(model, tokenizer, task, task.problems("sft")[-n:], cfg, logger.console)}
    result["eval_seconds"] = time.time() - start
    logger.log(cfg.sft.steps, {"eval/test_greedy_accuracy": result["test"]["greedy_accuracy"],
                               "eval/sft_greedy_accuracy": result["sft_distribution"]["greedy_accuracy"]}, echo=True)
    return result
