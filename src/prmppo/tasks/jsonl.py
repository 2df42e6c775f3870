"""`task=jsonl`: problems from your own JSONL or Parquet files, in verl's row layout by default.

    python -m prmppo task=jsonl task.train_path=data/train.parquet task.test_path=data/test.parquet \\
        model=hf model.path=/ckpt/qwen2.5-1.5b-instruct prm_train.label_source=monte_carlo

A row (JSON object or Parquet row) gives, by dotted path:
  task.prompt_key    (`prompt`)                    a string, or a list of chat messages {role, content}
  task.answer_key    (`reward_model.ground_truth`) the gold final answer (a string or a number)
  task.solution_key  (`extra_info.answer`)         optional: a worked gold solution, steps separated by
                                                   `task.step_delimiter`, for SFT
The `sft` split reads `task.sft_path` (default: the train file) and needs a solution in every row; `train`
and `test` rows without one get the answer-only solution `The answer is $\\boxed{<gold>}$.` (what the
verifier receipt checks). Every file is read and every row checked when the task is built, before any
weights: a row that lacks a field or whose ground truth `task.checker` cannot parse is refused with its
file and line (`task.bad_rows=refuse`), or skipped and counted (`skip`; `skipped_rows` per split, logged).

Prompts: `tasks/chat.py` renders the row's messages (a string prompt is one user message) through the
model's chat template (`model.chat_template`, `model.system_prompt`) or as plain text. Answers:
`tasks/answers.py` extracts them (`\\boxed{}`, `####`, "The answer is", the last number) and checks them
(`task.checker`: math_verify | numeric | exact). Steps: the response split at `task.step_delimiter`
("\\n", "\\n\\n" or a tag such as Math-Shepherd's "ки"). There is no exact step checker (`check_steps` is
None): step labels for a PRM come from Monte-Carlo completions (`prm_train.label_source=monte_carlo`).
"""

from __future__ import annotations

import logging
import os
import random
from pathlib import Path

from prmppo.config.schema import JsonlTaskConfig
from prmppo.errors import ConfigError, DataError
from prmppo.tasks.answers import CHECKERS, extract_answer, make_checker
from prmppo.tasks.base import SPLITS, Problem
from prmppo.tasks.chat import ChatPrompts
from prmppo.tasks.gsm8k import NUMBER_IN_TEXT_RE, parse_number, render_fraction
from prmppo.tasks.rows import field, read_rows

log = logging.getLogger("prmppo")

BAD_ROWS = ("refuse", "skip")
_SHOWN_BAD_ROWS = 5  # a refusal quotes this many rows and counts the rest


def answer_only_solution(answer: str) -> str:
    """The gold solution of a row that brings none: the answer alone, boxed."""
    return f"The answer is $\\boxed{{{answer}}}$."


def _messages(prompt, key: str) -> list[dict] | str:
    """The row's prompt as chat messages, or a sentence saying what is wrong with it."""
    if isinstance(prompt, str):
        return [{"role": "user", "content": prompt}] if prompt.strip() else f"{key!r} is an empty string"
    if isinstance(prompt, list) and prompt and all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in prompt):
        return [{"role": m["role"], "content": m["content"]} for m in prompt]
    return f"{key!r} must be a string or a non-empty list of {{role, content}} messages, got {type(prompt).__name__}"


class JsonlTask:
    """Problems from JSONL / Parquet files; outcome verifier by `task.checker`, no step checker."""

    name = "jsonl"

    def __init__(
        self,
        train_path: str,
        test_path: str,
        sft_path: str | None = JsonlTaskConfig.sft_path,
        prompt_key: str = JsonlTaskConfig.prompt_key,
        answer_key: str = JsonlTaskConfig.answer_key,
        solution_key: str = JsonlTaskConfig.solution_key,
        checker: str = JsonlTaskConfig.checker,
        bad_rows: str = JsonlTaskConfig.bad_rows,
        test_size: int | None = JsonlTaskConfig.test_size,
        step_delimiter: str = JsonlTaskConfig.step_delimiter,
        prompt_template: str = JsonlTaskConfig.prompt_template,
        chat_template: str = JsonlTaskConfig.chat_template,
        system_prompt: str | None = JsonlTaskConfig.system_prompt,
        tokenizer_path: str | None = JsonlTaskConfig.tokenizer_path,
    ) -> None:
        if bad_rows not in BAD_ROWS:
            raise ConfigError(f"task.bad_rows={bad_rows!r} is not one of {', '.join(BAD_ROWS)}")
        if checker not in CHECKERS:
            raise ConfigError(f"task.checker={checker!r} is not one of {', '.join(CHECKERS)}")
        if not step_delimiter:
            raise ConfigError("task.step_delimiter is empty; use '\\n', '\\n\\n' or a step tag")
        if test_size is not None and (isinstance(test_size, bool) or not isinstance(test_size, int) or test_size < 1):
            raise ConfigError(f"task.test_size must be a positive integer or null (all rows), got {test_size!r}")
        self.keys = {"prompt": prompt_key, "answer": answer_key, "solution": solution_key}
        self.checker = make_checker(checker)
        self.bad_rows, self.test_size, self.step_delimiter = bad_rows, test_size, step_delimiter
        self.chat = ChatPrompts(chat_template, tokenizer_path, system_prompt, prompt_template)
        self._gold: dict[str, object] = {}  # ground truth text -> the checker's parsed value
        self.skipped_rows: dict[str, int] = {}
        # resolved now, so a later change of working directory does not move the data
        paths = {"train": ("task.train_path", train_path), "test": ("task.test_path", test_path),
                 "sft": ("task.sft_path", sft_path or train_path)}
        self._rows = {split: self._read(split, key, Path(os.path.abspath(Path(path).expanduser())))
                      for split, (key, path) in paths.items()}
        self._alphabet: str | None = None

    # ------------------------------------------------------------------ reading and checking rows
    def _problem(self, row: object, where: str, split: str) -> Problem | str:
        """One row as a Problem, or the sentence saying why it cannot be one."""
        try:
            prompt, gold = field(row, self.keys["prompt"]), field(row, self.keys["answer"])
        except KeyError as missing:
            return f"missing field {missing.args[0]!r}"
        messages = _messages(prompt, self.keys["prompt"])
        if isinstance(messages, str):
            return messages
        if isinstance(gold, bool) or not isinstance(gold, (str, int, float)):
            return f"{self.keys['answer']!r} must be a string or a number, got {type(gold).__name__}"
        gold = str(gold).strip()
        if gold not in self._gold:
            parsed = self.checker.parse_gold(gold)
            if parsed is None:
                return f"ground truth {gold!r} at {self.keys['answer']!r} cannot be parsed by task.checker={self.checker.name}"
            self._gold[gold] = parsed
        try:
            solution = field(row, self.keys["solution"])
        except KeyError:
            solution = None
        if solution is not None and not (isinstance(solution, str) and solution.strip()):
            return f"{self.keys['solution']!r} must be a non-empty string, got {solution!r}"
        if solution is None and split == "sft":
            return (f"missing field {self.keys['solution']!r}: SFT rows need a gold solution (set task.sft_path to a "
                    "file that has one, or task.solution_key to its field)")
        users = [m["content"] for m in messages if m["role"] == "user"]
        meta = {"where": where, "messages": messages,
                "data_source": row.get("data_source") if isinstance(row, dict) else None}
        return Problem(question=users[-1] if users else messages[-1]["content"],
                       solution=solution.strip() if solution else answer_only_solution(gold), answer=gold, meta=meta)

    def _read(self, split: str, key: str, path: Path) -> list[Problem]:
        problems, bad = [], []
        for where, row in read_rows(path, key):
            made = self._problem(row, where, split)
            if isinstance(made, Problem):
                problems.append(made)
            else:
                bad.append(f"{where}: {made}")
        if bad and self.bad_rows == "refuse":
            more = f" (and {len(bad) - _SHOWN_BAD_ROWS} more)" if len(bad) > _SHOWN_BAD_ROWS else ""
            raise DataError(f"{len(bad)} bad row(s) in the {split} split: " + "; ".join(bad[:_SHOWN_BAD_ROWS]) + more
                            + ". Fix them, or set task.bad_rows=skip to leave them out and count them")
        if bad:
            self.skipped_rows[split] = len(bad)
            log.warning("task=jsonl: skipped %d bad row(s) of %s (%s split), e.g. %s", len(bad), path, split, bad[0])
        if not problems:
            raise DataError(f"{key}={str(path)!r} holds no usable row for the {split} split")
        return problems

    # ------------------------------------------------------------------ the Task contract
    def problems(self, split: str) -> list[Problem]:
        """`sft`: the sft file (default the train file); `train`; `test`: its first `test_size` rows if set."""
        if split not in SPLITS:
            raise ValueError(f"unknown split {split!r}; valid splits are {SPLITS}")
        rows = self._rows[split]
        return list(rows[: self.test_size] if split == "test" and self.test_size else rows)

    def format_prompt(self, problem: Problem) -> str:
        """The row's messages rendered by `tasks/chat.py` (chat template or plain text)."""
        return self.chat.render(problem.meta["messages"])

    def extract_answer(self, response: str) -> str | None:
        return extract_answer(response)

    def verify(self, problem: Problem, response: str) -> bool:
        """True iff the response's extracted answer equals the gold answer under `task.checker`."""
        answer = extract_answer(response)
        if answer is None:
            return False
        if problem.answer not in self._gold:
            self._gold[problem.answer] = self.checker.parse_gold(problem.answer)
        return self.checker.equal(self._gold[problem.answer], answer)

    def split_steps(self, response: str) -> list[str]:
        """The response cut at `task.step_delimiter`, pieces stripped, empty ones dropped."""
        return [step.strip() for step in response.split(self.step_delimiter) if step.strip()]

    def check_steps(self, problem: Problem, response: str) -> None:
        """No exact step checker: step labels come from Monte-Carlo completions."""
        return None

    def difficulty(self, problem: Problem) -> dict[str, int]:
        """`{"gold_steps": n}`: the steps of the gold solution before its answer step."""
        return {"gold_steps": max(len(self.split_steps(problem.solution)) - 1, 0)}

    def corrupt(self, problem: Problem, position: int, rng: random.Random) -> str:
        """The gold solution with step `position`'s last number moved and its answer step replaced by a wrong
        answer: the gold number moved by a nonzero offset, or (a non-numeric gold) a large integer."""
        steps = self.split_steps(problem.solution)
        body = steps[:-1]
        if 0 <= position < len(body):
            numbers = list(NUMBER_IN_TEXT_RE.finditer(body[position]))
            if numbers:
                last, value = numbers[-1], parse_number(numbers[-1].group(0))
                if value is not None:
                    body[position] = (body[position][: last.start()] + render_fraction(value + rng.randint(1, 9))
                                      + body[position][last.end():])
        gold = parse_number(problem.answer)
        offset = rng.choice([d for d in range(-9, 10) if d != 0])
        wrong = render_fraction(gold + offset) if gold is not None else str(rng.randint(10**6, 10**7))
        return self.step_delimiter.join(body + [answer_only_solution(wrong)])

    def alphabet(self) -> str:
        """Every character of the rendered prompts and the solutions of every split, and what `corrupt` writes."""
        if self._alphabet is None:
            chars = set(answer_only_solution("0123456789-./")) | set(self.step_delimiter)
            for split in ("sft", "train", "test"):
                for problem in self._rows[split]:
                    chars.update(self.format_prompt(problem))
                    chars.update(problem.solution)
            self._alphabet = "".join(sorted(chars))
        return self._alphabet
