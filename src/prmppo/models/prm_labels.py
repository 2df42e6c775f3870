"""Step labels for training the PRM (part of stage `prm`; the runner is `stages/prm.py`).

Two label sources (`prm_train.label_source`), both returning `StepExample`s (prompt ids,
response ids, step-end token positions, labels in [0, 1]) whose labels run up to and including
the first wrong step (the response is cut there too: later tokens carry no label, and causal
attention means they could not change the earlier scores anyway):

- `checker`: per problem, `samples_per_problem` responses sampled from the current policy at
  temperature 1, one gold solution corrupted at a random step (`task.corrupt`) and the gold
  solution itself; every step labelled by the task's exact step checker (`task.check_steps`,
  first-error semantics) and aligned with the token step ends (`rewards/steps.py`).
- `monte_carlo`: Math-Shepherd (Wang et al. 2024, "Math-Shepherd: Verify and Reinforce LLMs
  Step-by-step without Human Annotations"): from the prefix ending at each step end of a sampled
  response, `mc_completions` completions by the policy; hard estimation = 1 if any completion
  reaches the gold answer, soft = the fraction that do. The step ended by EOS is labelled by the
  verifier on the response itself. A step is "wrong" (and the labels stop) when its estimate is 0.

A sampler is any callable `(prompt token rows, n) -> response token rows` (prompt-major, n per
prompt, EOS kept when produced); `PolicySampler` wraps the built-in engine's sampling loop, and
tests pass a stub whose completions are known.
"""

from __future__ import annotations

import random
from typing import Callable, NamedTuple

import torch

from prmppo.rewards.steps import StepBoundaries, align_step_labels
from prmppo.logger.console import progress
from prmppo.rollout.decoding import sample_responses

Sampler = Callable[[list[list[int]], int], list[list[int]]]
LABEL_SOURCES = ("checker", "monte_carlo")
ESTIMATIONS = ("hard", "soft")


class StepExample(NamedTuple):
    prompt_ids: list[int]
    response_ids: list[int]
    step_end_positions: list[int]  # indices into response_ids, increasing
    labels: list[float]  # one per step end, in [0, 1]


class PolicySampler:
    """Samples from an in-process causal LM with one seeded generator (reproducible call sequence)."""

    def __init__(self, model, *, temperature: float, max_new_tokens: int, eos_token_id: int, pad_token_id: int,
                 batch_rows: int, seed: int, show_progress: bool = False):
        self.model, self.temperature, self.max_new_tokens = model, temperature, max_new_tokens
        self.show_progress = show_progress
        self.eos_token_id, self.pad_token_id, self.batch_rows = eos_token_id, pad_token_id, batch_rows
        self.generator = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)

    def __call__(self, prompt_ids: list[list[int]], n: int) -> list[list[int]]:
        was_training = self.model.training
        self.model.eval()
        per_batch, out = max(1, self.batch_rows // n), []
        batches = range(0, len(prompt_ids), per_batch)
        for start in progress(batches, desc=f"sampling x{n}", unit="batch", enabled=self.show_progress, leave=False):
            tokens, _, _ = sample_responses(
                self.model, prompt_ids[start:start + per_batch], n, self.max_new_tokens, self.temperature, 1.0,
                self.generator, self.eos_token_id, self.pad_token_id)
            out.extend(tokens)
        self.model.train(was_training)
        return out


def row_step_ends(boundaries: StepBoundaries, response_ids: list[int]) -> list[int]:
    """Step-end positions of one response (see `rewards.steps.step_end_mask`)."""
    ids = torch.tensor([response_ids], dtype=torch.long)  # [1, T]
    return boundaries.mask(ids, torch.ones_like(ids)).squeeze(0).nonzero().squeeze(-1).tolist()


def truncate_at_first_error(prompt: list[int], response: list[int], ends: list[int],
                            labels: list[float]) -> StepExample:
    """Keep steps up to and including the first one labelled 0 (the first wrong step)."""
    wrong = [k for k, label in enumerate(labels) if label == 0.0]
    keep = wrong[0] + 1 if wrong else len(labels)
    return StepExample(prompt, response[: ends[keep - 1] + 1], ends[:keep], [float(x) for x in labels[:keep]])


def encode_solution(tokenizer, text: str) -> list[int]:
    """A solution text as response tokens, EOS-terminated like the SFT data."""
    return tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]


def corrupt_at_random_step(task, problem, rng: random.Random) -> tuple[str, int] | None:
    """(gold solution corrupted at a random step before the answer line, that step), or None."""
    n_steps = len(task.split_steps(problem.solution)) - 1  # the last step is the answer line
    if n_steps < 1:
        return None
    position = rng.randrange(n_steps)
    return task.corrupt(problem, position, rng), position


def checker_labels(task, tokenizer, problems, sampler: Sampler, samples_per_problem: int,
                   boundaries: StepBoundaries, rng: random.Random) -> list[StepExample]:
    """Policy samples + one corrupted + one gold solution per problem, labelled by `check_steps`."""
    prompts = [tokenizer(task.format_prompt(p))["input_ids"] for p in problems]
    sampled = sampler(prompts, samples_per_problem) if samples_per_problem > 0 else []
    examples = []
    for i, (problem, prompt) in enumerate(zip(problems, prompts)):
        responses = list(sampled[i * samples_per_problem:(i + 1) * samples_per_problem])
        corrupted = corrupt_at_random_step(task, problem, rng)
        if corrupted is not None:
            responses.append(encode_solution(tokenizer, corrupted[0]))
        responses.append(encode_solution(tokenizer, problem.solution))
        for response in responses:
            ends = row_step_ends(boundaries, response)
            labels = align_step_labels(task, problem, tokenizer, response, ends, boundaries.delimiter_ids)
            examples.append(truncate_at_first_error(prompt, response, ends, [float(x) for x in labels]))
    return examples


def monte_carlo_labels(task, tokenizer, problems, sampler: Sampler, samples_per_problem: int, mc_completions: int,
                       estimation: str, boundaries: StepBoundaries) -> list[StepExample]:
    """Math-Shepherd hard/soft estimation from `mc_completions` completions of every step prefix."""
    if estimation not in ESTIMATIONS:
        raise ValueError(f"prm_train.estimation={estimation!r} is not one of {', '.join(ESTIMATIONS)}")
    prompts = [tokenizer(task.format_prompt(p))["input_ids"] for p in problems]
    sampled = sampler(prompts, samples_per_problem)
    rows = []  # (problem, prompt, response, ends)
    queries = []  # prompt + response prefix for every step end that is not EOS
    for i, response in enumerate(sampled):
        problem, prompt = problems[i // samples_per_problem], prompts[i // samples_per_problem]
        ends = row_step_ends(boundaries, response)
        rows.append((problem, prompt, response, ends))
        queries.extend(prompt + response[: e + 1] for e in ends if response[e] != boundaries.eos_token_id)
    completions = iter(sampler(queries, mc_completions) if queries else [])
    examples = []
    for problem, prompt, response, ends in rows:
        labels = []
        for e in ends:
            if response[e] == boundaries.eos_token_id:  # the response is its own completion
                labels.append(float(task.verify(problem, tokenizer.decode(response, skip_special_tokens=True))))
                continue
            texts = [tokenizer.decode(response[: e + 1] + next(completions), skip_special_tokens=True)
                     for _ in range(mc_completions)]
            hits = sum(task.verify(problem, text) for text in texts)
            labels.append(float(hits > 0) if estimation == "hard" else hits / mc_completions)
        examples.append(truncate_at_first_error(prompt, response, ends, labels))
    return examples


def make_step_labels(label_source: str, *, task, tokenizer, problems, sampler: Sampler, samples_per_problem: int,
                     mc_completions: int, estimation: str, boundaries: StepBoundaries,
                     rng: random.Random) -> list[StepExample]:
    """Step-labelled examples from `label_source` (`checker` | `monte_carlo`)."""
    if label_source == "checker":
        probe = problems[0]
        if task.check_steps(probe, probe.solution) is None:
            raise ValueError(f"prm_train.label_source=checker needs a task with an exact step checker, but task "
                             f"{task.name!r} has none; use prm_train.label_source=monte_carlo")
        return checker_labels(task, tokenizer, problems, sampler, samples_per_problem, boundaries, rng)
    if label_source == "monte_carlo":
        return monte_carlo_labels(task, tokenizer, problems, sampler, samples_per_problem, mc_completions,
                                  estimation, boundaries)
    raise ValueError(f"prm_train.label_source={label_source!r} is not one of {', '.join(LABEL_SOURCES)}")
