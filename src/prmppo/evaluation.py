"""Accuracy of a policy on task problems: greedy, sampled (mean over k samples), and pass@k.

Used at the end of SFT, by the `eval` stage and by the canary. Generation runs in-process
through the built-in engine's batched sampler (`rollout/hf_engine.py`), so the numbers are
those of the same sampler the PPO rollouts use. pass@k uses the unbiased estimator of
Chen et al. 2021 ("Evaluating Large Language Models Trained on Code", eq. 1):
pass@k = E[1 - C(n - c, k) / C(n, k)] with n samples of which c are correct.
"""

from __future__ import annotations

import hashlib
from math import comb

import torch

from prmppo.logger.console import progress
from prmppo.rollout.decoding import sample_responses


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k for one problem with `c` correct out of `n` samples (k <= n)."""
    if n - c < k:
        return 1.0
    return 1.0 - comb(n - c, k) / comb(n, k)


def generate_texts(model, tokenizer, prompts: list[str], *, n: int, temperature: float, max_new_tokens: int,
                   batch_rows: int, seed: int, show_progress: bool = False) -> list[str]:
    """Decoded responses, prompt-major (`n` per prompt); temperature 0 means greedy."""
    prompt_ids = [tokenizer(p)["input_ids"] for p in prompts]
    per_batch = max(1, batch_rows // n)
    texts: list[str] = []
    batches = range(0, len(prompt_ids), per_batch)
    desc = "greedy" if temperature == 0 else f"sampling x{n}"
    # decoder layers compiled for the PPO update (`ppo.compile`: the test evaluation and the canary during PPO
    # generate with the trainer's policy) run eagerly here: with a KV cache each layer and cache state would
    # be a new graph, and past dynamo's recompile limit the update's own graphs would never be compiled
    with torch.compiler.set_stance("force_eager"):
        for start in progress(batches, desc=desc, unit="batch", enabled=show_progress, leave=False):
            generator = torch.Generator(device=next(model.parameters()).device).manual_seed(seed + start)
            tokens, _, _ = sample_responses(
                model, prompt_ids[start:start + per_batch], n_samples_per_prompt=n, max_new_tokens=max_new_tokens,
                temperature=temperature, top_p=1.0, generator=generator,
                eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
            texts.extend(tokenizer.decode(row, skip_special_tokens=True) for row in tokens)
    return texts


def problem_id(problem) -> str:
    """A short stable id of a problem (the first 12 hex digits of its question's SHA-1): the same test problem
    has the same id in every run, whatever its position."""
    return hashlib.sha1(problem.question.encode("utf-8")).hexdigest()[:12]


def score(model, tokenizer, task, problems, *, k: int, temperature: float, max_new_tokens: int,
          batch_rows: int, seed: int, greedy: bool = True, show_progress: bool = False,
          per_problem: bool = False) -> dict:
    """`greedy_accuracy`, `sampled_accuracy` (mean over k samples) and `pass@k` over `problems`; with
    `per_problem`, also `problems`: for each problem in order its `index`, `id` (`problem_id`), the task's
    `difficulty`, `greedy_correct` (with `greedy`) and `correct_of_k` of its `k` samples (with k > 0), the
    outcomes a bootstrap over prompts and seeds resamples."""
    was_training = model.training
    model.eval()
    prompts = [task.format_prompt(p) for p in problems]
    result: dict = {"n_problems": float(len(problems))}
    rows = [{"index": i, "id": problem_id(p), "difficulty": task.difficulty(p)} for i, p in enumerate(problems)] \
        if per_problem else [{} for _ in problems]
    if greedy:
        texts = generate_texts(model, tokenizer, prompts, n=1, temperature=0.0, max_new_tokens=max_new_tokens,
                               batch_rows=batch_rows, seed=seed, show_progress=show_progress)
        verdicts = [task.verify(p, t) for p, t in zip(problems, texts)]
        result["greedy_accuracy"] = sum(verdicts) / len(problems)
        for row, verdict in zip(rows, verdicts):
            row["greedy_correct"] = bool(verdict)
    if k > 0:
        texts = generate_texts(model, tokenizer, prompts, n=k, temperature=temperature,
                               max_new_tokens=max_new_tokens, batch_rows=batch_rows, seed=seed,
                               show_progress=show_progress)
        correct = [sum(task.verify(p, texts[i * k + j]) for j in range(k)) for i, p in enumerate(problems)]
        result["sampled_accuracy"] = sum(correct) / (k * len(problems))
        result[f"pass@{k}"] = sum(pass_at_k(k, c, k) for c in correct) / len(problems)
        if k >= 2:
            result["pass@2"] = sum(pass_at_k(k, c, 2) for c in correct) / len(problems)
        for row, right in zip(rows, correct):
            row.update(correct_of_k=int(right), k=k)
    if per_problem:
        result["problems"] = rows
    model.train(was_training)
    return result
