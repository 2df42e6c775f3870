"""The task contract: prompts, gold solutions, answer extraction, verifier, steps.

A task owns everything that knows what a problem *means*. The trainer, the reward and
the rollout engine only see strings and token ids; they ask the task to format a prompt,
to verify a response, to split it into steps and (where the task can) to check each step.

Nothing here evaluates model text as code: answers are parsed with regular expressions and
arithmetic is done on parsed integers / fractions.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

SPLITS = ("sft", "train", "test")
"""`sft`: worked solutions for the warm start; `train`: RL prompts; `test`: held-out RL prompts."""


@dataclass(frozen=True)
class Problem:
    """One problem with its gold worked solution.

    `question` is the raw problem text; `solution` is the gold response text (steps joined by
    the task's step delimiter, ending with the answer line); `answer` is the gold answer in the
    task's normalised string form (e.g. "-12", "3.5").
    """

    question: str
    solution: str
    answer: str
    meta: dict = field(default_factory=dict, compare=False, hash=False)


@runtime_checkable
class Task(Protocol):
    """What every task provides. Implementations: `ArithTask`, `GSM8KTask`."""

    name: str
    step_delimiter: str  # text that ends a reasoning step in a response, e.g. "\n"

    def problems(self, split: str) -> list[Problem]:
        """Deterministic list of problems of one of `SPLITS`; `train`/`sft` and `test` are disjoint."""

    def format_prompt(self, problem: Problem) -> str:
        """The text the policy is conditioned on; the response follows it directly."""

    def extract_answer(self, response: str) -> str | None:
        """The normalised final answer in a response, or None when there is none."""

    def verify(self, problem: Problem, response: str) -> bool:
        """Outcome verifier: True when the response's final answer equals the gold answer."""

    def split_steps(self, response: str) -> list[str]:
        """The response's reasoning steps, in order, without delimiters; empty steps dropped."""

    def check_steps(self, problem: Problem, response: str) -> list[bool] | None:
        """Exact per-step correctness, or None when the task has no exact step checker."""

    def difficulty(self, problem: Problem) -> dict[str, int]:
        """What makes this problem hard, as named counts (e.g. `{"operands": 4}`); reports group the final
        evaluation's per-problem outcomes by it."""

    def corrupt(self, problem: Problem, position: int, rng: random.Random) -> str:
        """The gold solution with step `position` (0-based) made wrong; the final answer is wrong too."""

    def alphabet(self) -> str:
        """Every character that prompts and solutions of this task can contain (for char tokenizers)."""
