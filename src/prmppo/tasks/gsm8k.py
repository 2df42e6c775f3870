"""GSM8K: grade-school word problems read from the original JSONL files.

Each row is {"question": ..., "answer": ...}; the answer is a worked solution, one step a line,
with calculator annotations such as `<<16-3-4=9>>` and a final line `#### 18`. This module turns
a row into a `Problem`:

    question  the row's question, unchanged
    solution  the worked solution, annotations removed, blank lines dropped, and the
              `#### N` line replaced by `Answer: N` (N normalised)
    answer    the normalised gold number, e.g. "18", "1000", "0.5"

Prompts are `Question: <question>\\nAnswer:\\n` and the response is the solution text.
Numbers are compared in a normalised string form (`normalize_number`), parsed with
`fractions.Fraction`; model text is never evaluated. There is no exact step checker, so
`check_steps` returns None and step labels come from Monte-Carlo completions elsewhere.

`sft` and `train` both read the train file; `test` reads the test file (optionally its first
`test_size` rows). The two files of GSM8K share no question.

Build it from config with `_target_: prmppo.tasks.gsm8k.GSM8KTask` and `data_dir` pointing at
the folder that holds train.jsonl and test.jsonl (a relative path is resolved against the
working directory at construction time).
"""

from __future__ import annotations

import json
import os
import random
import re
from fractions import Fraction
from pathlib import Path

from prmppo.config.schema import GSM8KTaskConfig
from prmppo.errors import DataError, DataFileMissing
from prmppo.tasks.base import SPLITS, Problem


_ANNOTATION_RE = re.compile(r"<<[^>]*>>")
_FINAL_RE = re.compile(r"####\s*(.*)")
# A plain decimal (optionally "1/2"-style fraction) after `$`, `,` and a trailing `.` are removed.
_PLAIN_NUMBER_RE = re.compile(r"-?(?:\d+(?:\.\d*)?|\.\d+)(?:/\d+)?")
# A number inside running text: thousands separators only in groups of three, and a minus
# sign only when it cannot be a subtraction ("16-3" yields 16 and 3, not -3).
NUMBER_IN_TEXT_RE = re.compile(r"(?<![\w.])-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|(?<![\w.])-?\.\d+")
_ANSWER_MARKER = "Answer:"
_PROMPT_TEMPLATE = "Question: {question}\nAnswer:\n"


def render_fraction(value: Fraction) -> str:
    """Integers as plain ints, terminating decimals without trailing zeros, else "p/q"."""
    if value.denominator == 1:
        return str(value.numerator)
    twos, fives, rest = 0, 0, value.denominator
    while rest % 2 == 0:
        rest, twos = rest // 2, twos + 1
    while rest % 5 == 0:
        rest, fives = rest // 5, fives + 1
    if rest != 1:
        return f"{value.numerator}/{value.denominator}"
    # Exact, in integers: scale to a power-of-ten denominator and place the decimal point. In
    # lowest terms max(twos, fives) places are exactly enough, so the last digit is never 0.
    places = max(twos, fives)
    scaled = abs(value.numerator) * 10**places // value.denominator
    digits = str(scaled).rjust(places + 1, "0")
    text = f"{digits[:-places]}.{digits[-places:]}"
    return ("-" if value < 0 else "") + text


def parse_number(text: str) -> Fraction | None:
    """The exact value of a number written like "$1,000", "12.0", "-3", "0.50", "1/2"; else None."""
    cleaned = text.strip().replace("$", "").replace(",", "").replace(" ", "").rstrip(".")
    if not _PLAIN_NUMBER_RE.fullmatch(cleaned):
        return None
    try:
        return Fraction(cleaned)
    except (ValueError, ZeroDivisionError):
        return None  # e.g. "1/0"


def normalize_number(text: str) -> str | None:
    """Canonical string of a number ("12.0" -> "12", "1,000" -> "1000", "0.50" -> "0.5"), else None."""
    value = parse_number(text)
    return None if value is None else render_fraction(value)


def _first_number(text: str) -> str | None:
    match = NUMBER_IN_TEXT_RE.search(text)
    return normalize_number(match.group(0)) if match else None


def _last_number(text: str) -> str | None:
    matches = NUMBER_IN_TEXT_RE.findall(text)
    return normalize_number(matches[-1]) if matches else None


def _row_error(path: Path, line_no: int, what: str) -> DataError:
    return DataError(f"{path}: line {line_no}: {what}")


def parse_row(row: object, path: Path, line_no: int) -> Problem:
    """One decoded JSONL row as a Problem; ValueError naming file and line if it is malformed."""
    if not isinstance(row, dict):
        what = f"expected a JSON object with 'question' and 'answer', got {type(row).__name__}"
        raise _row_error(path, line_no, what)
    for key in ("question", "answer"):
        if key not in row:
            raise _row_error(path, line_no, f"missing key {key!r} (rows need 'question' and 'answer')")
        if not isinstance(row[key], str):
            raise _row_error(path, line_no, f"{key!r} must be a string, got {type(row[key]).__name__}")
    raw_answer = row["answer"]
    lines = [line.strip() for line in _ANNOTATION_RE.sub("", raw_answer).split("\n")]
    lines = [line for line in lines if line]
    final = _FINAL_RE.fullmatch(lines[-1]) if lines else None
    if final is None:
        raise _row_error(path, line_no, "answer has no final '#### <number>' line")
    gold = normalize_number(final.group(1))
    if gold is None:
        raise _row_error(path, line_no, f"final line '#### {final.group(1)}' does not hold a number")
    solution = "\n".join(lines[:-1] + [f"{_ANSWER_MARKER} {gold}"])
    meta = {"line": line_no, "raw_answer": raw_answer}
    return Problem(question=row["question"], solution=solution, answer=gold, meta=meta)


def read_problems(path: Path) -> list[Problem]:
    """Every non-blank row of a GSM8K JSONL file, in file order."""
    if not path.is_file():
        raise DataFileMissing(f"GSM8K file not found: {path} (set task.data_dir to the folder that holds it)")
    problems = []
    with path.open(encoding="utf-8") as handle:
        for line_no, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as error:
                raise _row_error(path, line_no, f"bad JSON ({error.msg} at column {error.colno})") from None
            problems.append(parse_row(row, path, line_no))
    return problems


class GSM8KTask:
    """GSM8K from local JSONL files: outcome verifier on normalised numbers, no step checker."""

    name = "gsm8k"

    def __init__(
        self,
        data_dir: str,
        train_file: str = GSM8KTaskConfig.train_file,
        test_file: str = GSM8KTaskConfig.test_file,
        test_size: int | None = GSM8KTaskConfig.test_size,
        step_delimiter: str = GSM8KTaskConfig.step_delimiter,
    ) -> None:
        # Resolved now, so a later change of working directory does not move the data.
        self.data_dir = Path(os.path.abspath(Path(data_dir).expanduser()))
        self.files = {"train": self.data_dir / train_file, "test": self.data_dir / test_file}
        positive_int = isinstance(test_size, int) and not isinstance(test_size, bool) and test_size > 0
        if test_size is not None and not positive_int:
            raise ValueError(f"task.test_size must be a positive integer or null (all rows), got {test_size!r}")
        self.test_size = test_size
        if step_delimiter != "\n":
            raise ValueError(f"task.step_delimiter must be '\\n' (the only one supported), got {step_delimiter!r}")
        self.step_delimiter = step_delimiter
        self._rows: dict[str, list[Problem]] = {}
        self._alphabet: str | None = None

    def _file_problems(self, which: str) -> list[Problem]:
        if which not in self._rows:
            self._rows[which] = read_problems(self.files[which])
        return self._rows[which]

    def problems(self, split: str) -> list[Problem]:
        """`sft` and `train`: the train file; `test`: the test file, first `test_size` rows if set."""
        if split not in SPLITS:
            raise ValueError(f"unknown split {split!r}; valid splits are {SPLITS}")
        if split != "test":
            return list(self._file_problems("train"))
        rows = self._file_problems("test")
        if self.test_size is None:
            return list(rows)
        if self.test_size > len(rows):
            raise ValueError(
                f"task.test_size ({self.test_size}) exceeds the {len(rows)} rows of {self.files['test']}; "
                "lower it or set it to null for all rows"
            )
        return rows[: self.test_size]

    def format_prompt(self, problem: Problem) -> str:
        """`Question: ...` then `Answer:` on its own line; the worked solution follows."""
        return _PROMPT_TEMPLATE.format(question=problem.question)

    def extract_answer(self, response: str) -> str | None:
        """Number after the last "Answer:", else after the last "####", else the last number."""
        for marker in (_ANSWER_MARKER, "####"):
            at = response.rfind(marker)
            if at >= 0:
                return _first_number(response[at + len(marker) :])
        return _last_number(response)

    def verify(self, problem: Problem, response: str) -> bool:
        """True iff the normalised final answer equals the normalised gold answer."""
        answer = self.extract_answer(response)
        return answer is not None and answer == problem.answer

    def split_steps(self, response: str) -> list[str]:
        """Lines of the response, stripped, empty lines dropped (the answer line is a step)."""
        return [line.strip() for line in response.split(self.step_delimiter) if line.strip()]

    def difficulty(self, problem: Problem) -> dict[str, int]:
        """`{"gold_steps": n}`: the reasoning lines of the gold solution, its answer line not counted."""
        return {"gold_steps": len(self.split_steps(problem.solution)) - 1}

    def check_steps(self, problem: Problem, response: str) -> None:
        """GSM8K has no exact step checker; step labels come from Monte-Carlo completions."""
        return None

    def corrupt(self, problem: Problem, position: int, rng: random.Random) -> str:
        """Gold solution with step `position`'s last number changed and a wrong final answer.

        The number gets a nonzero offset in [-9, 9]. A step without any number gets a wrong
        number appended instead, so every position can be corrupted.
        """
        steps = self.split_steps(problem.solution)[:-1]  # the last line is "Answer: N"
        if not 0 <= position < len(steps):
            raise ValueError(
                f"corrupt position {position} out of range: this solution has {len(steps)} steps "
                f"before its answer line, valid positions are 0..{len(steps) - 1}"
            )
        offsets = [d for d in range(-9, 10) if d != 0]
        step = steps[position]
        matches = list(NUMBER_IN_TEXT_RE.finditer(step))
        if matches:
            last = matches[-1]
            wrong = render_fraction(parse_number(last.group(0)) + rng.choice(offsets))
            steps[position] = step[: last.start()] + wrong + step[last.end() :]
        else:
            steps[position] = f"{step} {rng.randint(1, 99)}"
        wrong_answer = render_fraction(Fraction(problem.answer) + rng.choice(offsets))
        return "\n".join(steps + [f"{_ANSWER_MARKER} {wrong_answer}"])

    def alphabet(self) -> str:
        """Sorted unique characters of both files' questions and solutions, plus the prompt and
        answer templates and the characters `corrupt` can write."""
        if self._alphabet is None:
            chars = set(_PROMPT_TEMPLATE.format(question="")) | set("0123456789-./ ")
            for which in ("train", "test"):
                for problem in self._file_problems(which):
                    chars.update(problem.question)
                    chars.update(problem.solution)
            self._alphabet = "".join(sorted(chars))
        return self._alphabet
