"""Stage `prm`: train the process reward model on the SFT checkpoint, evaluate it, publish it.

    python -m prmppo stage=prm                                   # embedded default: arith, tiny model
    python -m prmppo stage=prm prm_train.head=step_logprobs      # the likelihood-based head
    python -m prmppo stage=prm prm_train.head=label_tokens       # Math-Shepherd-style label tokens
    python -m prmppo stage=prm prm_train.label_source=monte_carlo prm_train.estimation=soft
    python -m prmppo stage=prm debug=smoke                       # seconds

Steps (`ensure_prm`):
  1. labels    step-labelled responses from `prm_train.label_source` (models/prm_labels.py);
  2. train     a fresh `prm` LoRA adapter + head (models/prm.py) on the frozen SFT backbone:
               binary cross-entropy at step ends (soft labels allowed), AdamW, warmup-cosine; the
               default `mode_gap` head (and `log_ratio`) compares the adapted LM with the SFT model
               (adapters off), whose logprobs of every example are computed once before the first step;
  3. evaluate  on held-out `test` solutions, half of them corrupted at a random step: step
               accuracy (threshold 0.5) over the labelled steps (up to the first error), and
               first-error-step F1 in the style of ProcessBench (Zheng et al. 2024, "ProcessBench:
               Identifying Process Errors in Mathematical Reasoning"): the harmonic mean of the
               accuracy on erroneous solutions (predicted first-error step == true one) and on
               correct ones (no step predicted wrong); then best-of-N reranking of N policy samples
               per test problem with `min`, `product`, `mean` and `last` aggregation of step scores,
               against majority vote over the N final answers;
  4. publish   adapter + head (safetensors) + prm_meta.json as the `prm` artifact, keyed by
               (seed, task, model, sft, prm_train), so PPO with `arm=prm` reuses it.

    torchrun --nproc_per_node=2 -m prmppo stage=prm topology=fsdp hydra.run.dir=runs/prm2  # 2 FSDP2 ranks

Simplifications: examples are drawn uniformly with replacement; policy samples for labels and for
best-of-N come from the SFT policy at temperature 1.

Several ranks (`topology=fsdp`, `distributed/`), step by step:
  1. labels    every rank samples them (and the best-of-N candidates) on its own unsharded fp32 copy
               of the SFT model, with the same seeded calls, before the adapter exists; then rank 0's
               examples, candidates and RNG state are broadcast (`TorchRanks.from_main`), so every
               rank trains and evaluates on exactly rank 0's. Sampling on every rank, not on rank 0
               alone, keeps the others' wait in that broadcast to the ranks' skew: a wait as long as
               the sampling itself could outlast the process group's timeout (`distributed/launch.py`).
  2. train     data parallel: the PeftModel sharded by FSDP2 per decoder block and at the root (the
               `prm` LoRA factors with their blocks), the head replicated (its gradients summed over
               the ranks); every rank draws the same `prm_train.batch_rows` examples and trains on its
               own `batch_rows / N` of them; the loss is the weighted BCE sum over the global sum of
               step weights (all-reduced), gradients clipped on their global norm, so a step of N
               ranks is the one-process step up to float summation order.
  3. evaluate  on every rank through the sharded PRM (forward passes only, the same rows on every
               rank, so FSDP's all-gathers meet); rank 0 records it.
  4. publish   rank 0 alone (`stages/common.py make_or_reuse`): the full weights gathered into its plain
               copy of the PeftModel, saved in the usual layout; the others wait on a barrier.
"""

from __future__ import annotations

import logging
import math
import random
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from omegaconf import DictConfig

from prmppo.config.build import build
from prmppo.distributed.launch import close_ranks
from prmppo.distributed.ranks import OneProcess
from prmppo.distributed.shard import clip_global_norm
from prmppo.logger.console import log_milestone, progress as progress_bar
from prmppo.models.loading import DTYPES, load_tokenizer
from prmppo.models.prm import (LearnedStepScorer, make_head, new_prm, prm_step_logits, reference_token_logprobs,
                               save_prm)
from prmppo.ppo.batch import collate, pad_floats
from prmppo.ppo.maths import make_scheduler
from prmppo.rewards.steps import StepBoundaries, align_step_labels
from prmppo.stages.common import Made, make_or_reuse, open_metrics, open_ranks, train_device, write_stage_result
from prmppo.stages.sft_training import ensure_sft
from prmppo.stages.prm_external import evaluate_external_prm, prm_launch_gate
from prmppo.models.prm_labels import (PolicySampler, StepExample, corrupt_at_random_step, encode_solution,
                                      make_step_labels, row_step_ends)

log = logging.getLogger("prmppo")
AGGREGATIONS = ("min", "product", "mean", "last")

__all__ = ["ensure_prm", "evaluate_prm", "make_step_labels", "run", "train_prm"]


@dataclass
class ScoreRows:
    """The fields a step scorer reads, for rows of (prompt, response) token ids."""

    problems: list
    input_ids: torch.Tensor  # [B, P + T]
    attention_mask: torch.Tensor  # [B, P + T]
    position_ids: torch.Tensor  # [B, P + T]
    response_ids: torch.Tensor  # [B, T]
    response_mask: torch.Tensor  # [B, T]
    prompt_length: int

    @classmethod
    def build(cls, problems, prompts: list[list[int]], responses: list[list[int]], pad_token_id: int) -> "ScoreRows":
        return cls(problems, *collate(prompts, responses, pad_token_id))


def step_scores(scorer, problems, prompts, responses, pad_token_id: int) -> list[list[float]]:
    """Each response's step scores, in step order."""
    rows = ScoreRows.build(problems, prompts, responses, pad_token_id)
    scores, ends = scorer.score(rows)  # [B, T], [B, T]
    return [scores[b][ends[b]].tolist() for b in range(len(responses))]


# ------------------------------------------------------------------------------ 2. train


def reference_cache(peft_model, examples: list[StepExample], pad_token_id: int, device, rows: int,
                    of: str = "token") -> list[list[float]]:
    """Each example's response logprobs under the reference (adapters off: the SFT model; `of` as in
    `reference_token_logprobs`), `rows` examples per no-grad forward, for a head that reads gaps to the
    reference (`mode_gap`, `log_ratio`). The examples never change while the PRM trains, so one pass over
    them replaces a reference forward in every training step (on the default task 18,000 rows once against
    200 x 256)."""
    cache = []
    for start in range(0, len(examples), rows):
        chunk = examples[start:start + rows]
        ids, att, pos, plen, _, _ = train_batch(chunk, pad_token_id, device)
        logprobs = reference_token_logprobs(peft_model, ids, att, pos, plen, of).float().cpu()  # [b, T]
        cache.extend(row[:len(e.response_ids)].tolist() for row, e in zip(logprobs, chunk))
    return cache


def train_batch(examples: list[StepExample], pad_token_id: int, device) -> tuple:
    """(input_ids, attention_mask, position_ids, P, targets [b, T], label_mask [b, T] bool)."""
    ids, att, pos, response_ids, _, plen = collate([e.prompt_ids for e in examples],
                                                   [e.response_ids for e in examples], pad_token_id)
    targets = torch.zeros(response_ids.shape, dtype=torch.float32)  # [b, T]
    label_mask = torch.zeros(response_ids.shape, dtype=torch.bool)  # [b, T]
    for row, example in enumerate(examples):
        targets[row, example.step_end_positions] = torch.tensor(example.labels)
        label_mask[row, example.step_end_positions] = True
    return ids.to(device), att.to(device), pos.to(device), plen, targets.to(device), label_mask.to(device)


def step_bce_terms(logits: torch.Tensor, labels: torch.Tensor,
                   negative_weight: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """(weighted BCE-with-logits terms [n], weights [n]) of labelled steps; a step's weight is
    1 + (negative_weight - 1) * (1 - label), so a wrong step (label 0) counts `negative_weight` times."""
    weights = 1.0 + (negative_weight - 1.0) * (1.0 - labels)  # [n]
    terms = F.binary_cross_entropy_with_logits(logits, labels, reduction="none")  # [n]
    return terms * weights, weights


def step_bce(logits: torch.Tensor, labels: torch.Tensor, negative_weight: float = 1.0) -> torch.Tensor:
    """Weighted mean BCE-with-logits over labelled steps [n] (weights as in `step_bce_terms`)."""
    terms, weights = step_bce_terms(logits, labels, negative_weight)
    return terms.sum() / weights.sum()


def train_prm(peft_model, head, examples: list[StepExample], *, steps: int, batch_rows: int, lr: float,
              warmup_steps: int, pad_token_id: int, device, seed: int, logger, negative_weight: float = 1.0,
              ranks=None, log_every: int = 25) -> dict:
    """BCE-with-logits at labelled step ends; only the `prm` adapter and the head train. A head that reads gaps
    to the reference (`mode_gap`, `log_ratio`) reads the reference's logprobs from `reference_cache`, made
    first (its seconds count as training).

    `negative_weight` > 1 makes wrong steps count more (see `step_bce`). `ranks`: one process when None;
    under `topology=fsdp` each rank trains on its share of every batch (module docstring, step 2).
    """
    ranks = ranks if ranks is not None else OneProcess(device)
    params = [p for p in peft_model.parameters() if p.requires_grad] + list(head.parameters())
    optimizer = torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
    scheduler = make_scheduler(optimizer, total_steps=steps, warmup_steps=warmup_steps, min_ratio=0.1)
    generator = torch.Generator().manual_seed(seed)
    share = batch_rows // ranks.world_size  # validate.py: batch_rows divides by the world size
    start, loss_ema = time.time(), None
    reference = (reference_cache(peft_model, examples, pad_token_id, device, share, head.reference)
                 if head.reads == "token_log_ratios" else None)
    peft_model.train()
    head.train()
    progress = progress_bar(range(steps), desc="prm", unit="step", enabled=logger.console)
    for step in progress:
        picked = torch.randint(len(examples), (batch_rows,), generator=generator).tolist()
        mine = picked[ranks.rank * share:(ranks.rank + 1) * share]  # every rank drew the same rows
        ids, att, pos, plen, targets, label_mask = train_batch([examples[i] for i in mine], pad_token_id, device)
        ref = None if reference is None else pad_floats([reference[i] for i in mine], label_mask.shape[1]).to(device)
        logits = prm_step_logits(peft_model, head, ids, att, pos, plen, label_mask, ref)[label_mask]  # [n] rank's
        terms, weights = step_bce_terms(logits, targets[label_mask], negative_weight)
        total_weight = ranks.sum_floats({"weight": float(weights.sum())})["weight"]  # the batch's, every rank
        loss = terms.sum() / total_weight  # this rank's share of the batch's weighted mean
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        ranks.sum_grads(list(head.parameters()))  # replicated head; the adapter's grads FSDP sums
        clip_global_norm(params, 1.0)
        optimizer.step()
        scheduler.step()
        hits = ((logits > 0) == (targets[label_mask] >= 0.5)).float()  # [n]
        batch = ranks.sum_floats({"loss": loss.item(), "hits": float(hits.sum()), "steps": float(hits.numel())})
        loss_ema = batch["loss"] if loss_ema is None else 0.9 * loss_ema + 0.1 * batch["loss"]
        log_milestone("prm", step, steps, {"loss": loss_ema}, logger.console)
        if step % log_every == 0 or step == steps - 1:
            logger.log(step, {"prm/loss": batch["loss"], "prm/lr": scheduler.get_last_lr()[0],
                              "prm/batch_step_accuracy": batch["hits"] / max(batch["steps"], 1.0)})
            progress.set_postfix(loss=f"{loss_ema:.3f}")
    peft_model.eval()
    head.eval()
    return {"final_loss_ema": loss_ema, "train_seconds": time.time() - start, "examples": len(examples)}


# ------------------------------------------------------------------------------ 3. evaluate


def first_error_f1(predicted: list[int | None], true: list[int | None]) -> dict[str, float]:
    """ProcessBench-style F1 of first-error-step identification (None = no error)."""
    erroneous = [p == t for p, t in zip(predicted, true) if t is not None]
    correct = [p is None for p, t in zip(predicted, true) if t is None]
    acc_err = sum(erroneous) / len(erroneous) if erroneous else 0.0
    acc_corr = sum(correct) / len(correct) if correct else 0.0
    f1 = 2 * acc_err * acc_corr / (acc_err + acc_corr) if acc_err + acc_corr > 0 else 0.0
    return {"error_accuracy": acc_err, "correct_accuracy": acc_corr, "first_error_f1": f1}


def aggregate(scores: list[float], how: str) -> float:
    """One number per response from its step scores (`min` | `product` | `mean` | `last`)."""
    if not scores:
        return 0.0
    if how == "min":
        return min(scores)
    if how == "product":
        return math.prod(scores)
    if how == "mean":
        return sum(scores) / len(scores)
    if how == "last":
        return scores[-1]
    raise ValueError(f"aggregation {how!r} is not one of {', '.join(AGGREGATIONS)}")


def _held_out_solutions(task, tokenizer, problems, rng: random.Random) -> list[tuple[list[int], int | None]]:
    """(response ids, corrupted step or None) per problem: every second gold solution corrupted."""
    out = []
    for i, problem in enumerate(problems):
        corrupted = corrupt_at_random_step(task, problem, rng) if i % 2 else None
        text, position = corrupted if corrupted is not None else (problem.solution, None)
        out.append((encode_solution(tokenizer, text), position))
    return out


def _true_labels(task, problem, tokenizer, response, ends, position, delimiter_ids, has_checker) -> list[bool]:
    if has_checker:
        return align_step_labels(task, problem, tokenizer, response, ends, delimiter_ids)
    return [True] * len(ends) if position is None else [True] * position + [False] * (len(ends) - position)


def step_level_eval(scorer, task, tokenizer, problems, rng: random.Random) -> dict[str, float]:
    """Step accuracy (up to the first true error) and first-error F1 on held-out solutions."""
    boundaries, pad = scorer.boundaries, tokenizer.pad_token_id
    solutions = _held_out_solutions(task, tokenizer, problems, rng)
    prompts = [tokenizer(task.format_prompt(p))["input_ids"] for p in problems]
    scores = step_scores(scorer, problems, prompts, [s for s, _ in solutions], pad)
    has_checker = task.check_steps(problems[0], problems[0].solution) is not None
    hits = {True: [], False: []}  # per true label: was the prediction right
    predicted, true = [], []
    for problem, (response, position), row in zip(problems, solutions, scores):
        ends = row_step_ends(boundaries, response)
        labels = _true_labels(task, problem, tokenizer, response, ends, position, boundaries.delimiter_ids,
                              has_checker)
        first_true = labels.index(False) if False in labels else None
        for label, score in zip(labels[: (first_true + 1) if first_true is not None else None], row):
            hits[label].append((score >= 0.5) == label)
        first_pred = next((k for k, s in enumerate(row) if s < 0.5), None)
        predicted.append(first_pred)
        true.append(first_true)
    every = hits[True] + hits[False]
    return {"step_accuracy": sum(every) / max(len(every), 1),
            "step_accuracy_right_steps": sum(hits[True]) / max(len(hits[True]), 1),
            "step_accuracy_wrong_steps": sum(hits[False]) / max(len(hits[False]), 1),
            "labelled_steps": float(len(every)), **first_error_f1(predicted, true)}


def best_of_n_eval(scorer, task, tokenizer, problems, candidates: list[list[list[int]]]) -> dict[str, float]:
    """Accuracy of the PRM's pick among each problem's candidates per aggregation, and of majority vote."""
    n = len(candidates[0])
    prompts = [tokenizer(task.format_prompt(p))["input_ids"] for p in problems for _ in range(n)]
    flat_problems = [p for p in problems for _ in range(n)]
    responses = [c for row in candidates for c in row]
    scores = step_scores(scorer, flat_problems, prompts, responses, tokenizer.pad_token_id)
    texts = [tokenizer.decode(r, skip_special_tokens=True) for r in responses]
    correct = [task.verify(p, t) for p, t in zip(flat_problems, texts)]
    result = {"best_of_n": float(n), "mean_sample_accuracy": sum(correct) / len(correct)}
    for how in AGGREGATIONS:
        wins = 0
        for i in range(len(problems)):
            values = [aggregate(scores[i * n + j], how) for j in range(n)]
            wins += correct[i * n + values.index(max(values))]
        result[f"{how}_accuracy"] = wins / len(problems)
    votes = 0
    for i, problem in enumerate(problems):
        answers = [task.extract_answer(t) for t in texts[i * n:(i + 1) * n]]
        counted = Counter(a for a in answers if a is not None).most_common(1)
        votes += bool(counted) and counted[0][0] == problem.answer
    result["majority_accuracy"] = votes / len(problems)
    result["oracle_accuracy"] = sum(any(correct[i * n:(i + 1) * n]) for i in range(len(problems))) / len(problems)
    return result


def evaluate_prm(scorer, task, tokenizer, problems, candidates: list[list[list[int]]] | None,
                 rng: random.Random) -> dict[str, float]:
    """`step_level_eval` on `problems`, plus `best_of_n_eval` when `candidates` are given."""
    result = step_level_eval(scorer, task, tokenizer, problems, rng)
    if candidates:
        result.update({f"bon/{k}": v for k, v in best_of_n_eval(scorer, task, tokenizer, problems,
                                                                   candidates).items()})
    return result


# ------------------------------------------------------------------------------ runner


def _label_stats(examples: list[StepExample]) -> dict[str, float]:
    labels = [x for e in examples for x in e.labels]
    return {"examples": float(len(examples)), "labelled_steps": float(len(labels)),
            "positive_fraction": sum(x >= 0.5 for x in labels) / max(len(labels), 1)}


def ensure_prm(cfg: DictConfig, task, run_dir: Path, sft_checkpoint: Path, reuse: bool,
               ranks=None) -> tuple[Path, dict]:
    """The PRM artifact for this config and its summary: reused when `reuse` and it exists, else trained on
    `sft_checkpoint` and published (`make_or_reuse`: under the artifact's build lock, so parallel runs that
    need the same one wait for the first to build it). `ranks`: one process when None; under
    `topology=fsdp` every rank calls this."""
    ranks = ranks if ranks is not None else OneProcess(train_device(cfg))
    return make_or_reuse(cfg, "prm", ranks, lambda out: _train(cfg, task, run_dir, sft_checkpoint, ranks, out), reuse)


def _samples(cfg: DictConfig, task, tokenizer, model, boundaries, rng: random.Random, show_progress: bool):
    """1. (step-labelled examples, best-of-N candidates or None, `rng`'s state after them), sampled from
    `model` (the SFT policy: before the prm adapter exists, these are the policy's own samples)."""
    p = cfg.prm_train
    sampler = PolicySampler(model, temperature=1.0, max_new_tokens=p.max_new_tokens,
                            eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                            batch_rows=cfg.eval.batch_rows, seed=cfg.seed, show_progress=show_progress)
    examples = make_step_labels(
        p.label_source, task=task, tokenizer=tokenizer, problems=task.problems("train")[: p.train_problems],
        sampler=sampler, samples_per_problem=p.samples_per_problem, mc_completions=p.mc_completions,
        estimation=p.estimation, boundaries=boundaries, rng=rng)
    candidates = None
    if p.best_of_n > 0:
        test = task.problems("test")[: p.eval_problems]
        flat = sampler([tokenizer(task.format_prompt(q))["input_ids"] for q in test], p.best_of_n)
        candidates = [flat[i * p.best_of_n:(i + 1) * p.best_of_n] for i in range(len(test))]
    return examples, candidates, rng.getstate()


def _train(cfg: DictConfig, task, run_dir: Path, sft_checkpoint: Path, ranks, final: Path) -> Made:
    """Steps 1-3 on every rank (the PRM sharded under several ranks), ready to publish (step 4)."""
    p, device = cfg.prm_train, ranks.device
    tokenizer = load_tokenizer(sft_checkpoint)
    model = ranks.load_for_training(sft_checkpoint, cfg.model.dtype)
    boundaries = StepBoundaries.from_tokenizer(tokenizer, task.step_delimiter)
    rng = random.Random(f"{cfg.seed}-prm")
    summary: dict = {"prm_dir": str(final), "sft_checkpoint": str(sft_checkpoint)}
    log.info("training the PRM on %s: labels from %s on %d problems, then %d steps x %d responses",
             sft_checkpoint, p.label_source, p.train_problems, p.steps, p.batch_rows)
    with ranks.main_metrics(lambda: open_metrics(cfg, run_dir, "prm")) as logger:
        start = time.time()
        sampled = _samples(cfg, task, tokenizer, model, boundaries, rng, logger.console)  # on every rank
        examples, candidates, rng_state = ranks.from_main(lambda: sampled)  # rank 0's, on every rank
        rng.setstate(rng_state)
        summary["labels"] = {**_label_stats(examples), "seconds": time.time() - start}
        peft_model = new_prm(model, r=p.r, alpha=p.alpha, target_modules=list(p.target_modules), init_seed=cfg.seed)
        head = make_head(p.head, model.config.hidden_size, tokenizer, p.good_token, p.bad_token).to(device)
        full = ranks.shard(peft_model, DTYPES[cfg.model.dtype], also_check=(head,))
        summary["train"] = train_prm(peft_model, head, examples, steps=p.steps, batch_rows=p.batch_rows, lr=p.lr,
                                     warmup_steps=p.warmup_steps, pad_token_id=tokenizer.pad_token_id,
                                     device=device, seed=cfg.seed, logger=logger, negative_weight=p.negative_weight,
                                     ranks=ranks)
        scorer = LearnedStepScorer(peft_model, head, boundaries.delimiter_ids, boundaries.eos_token_id,
                                   p.chunk_rows, boundaries.blank_ids)
        start = time.time()
        summary["eval"] = evaluate_prm(scorer, task, tokenizer, task.problems("test")[: p.eval_problems], candidates,
                                       rng)
        summary["eval"]["seconds"] = time.time() - start
        logger.log(p.steps, {f"prm_eval/{k}": v for k, v in summary["eval"].items()}, echo=True)
    return Made(summary, lambda trained, tmp: save_prm(tmp, trained, head), full)


def run(cfg: DictConfig, run_dir: Path) -> dict:
    """Stage `prm`: the SFT checkpoint (reused or trained), then a freshly trained PRM, or reward=prm_external's
    checkpoint evaluated instead. Under `topology=fsdp` every rank runs this (torchrun); rank 0 writes the results."""
    start = time.time()
    task = build(cfg.task, "task")
    external = prm_launch_gate(cfg, task)  # before SFT or any weights: the label source, or the external PRM
    ranks = open_ranks(cfg, run_dir)
    try:
        sft_checkpoint, _ = ensure_sft(cfg, task, run_dir, reuse=True, ranks=ranks)
        summary = (evaluate_external_prm(cfg, task, run_dir, external, sft_checkpoint, evaluate_prm) if external
                   else ensure_prm(cfg, task, run_dir, sft_checkpoint, reuse=False, ranks=ranks)[1])
        summary["wall_seconds"] = time.time() - start
        if ranks.is_main:
            write_stage_result(run_dir, cfg, "prm", summary)
        return summary
    finally:
        close_ranks(ranks)
