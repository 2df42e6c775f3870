"""Final answers in free-form responses: where to find them, and when two of them are the same answer.

`extract_answer(text)` looks, in this order, for
  1. the last `\\boxed{...}` (or `\\fbox{...}`), braces balanced: `\\boxed{\\frac{1}{2}}` -> `\\frac{1}{2}`;
  2. the text after the last `####` on its line (GSM8K's final line), likewise;
  3. the text after the last "The answer is" to the end of its line or sentence, `$...$` unwrapped;
  4. the last number in the text;
and returns that text as written, or None.

A checker (`task.checker`) turns a ground truth into a comparable value once, refusing one it cannot
read (`parse_gold` -> None), and compares a response's extracted answer with it:
  math_verify  symbolic equivalence through Hugging Face's `math-verify` (LaTeX, fractions, decimals,
               sets, intervals): `\\frac{1}{2}`, `\\dfrac12` and `0.5` are one answer;
  numeric      exact rational equality of plain numbers ("1,000", "$12.0", "1/2"), parsed with
               `fractions.Fraction` (the GSM8K rule);
  exact        string equality once surrounding whitespace is stripped.
No checker evaluates model text as code: math-verify parses LaTeX and sympy expressions.
"""

from __future__ import annotations

import re
from fractions import Fraction

from prmppo.tasks.gsm8k import NUMBER_IN_TEXT_RE, parse_number

CHECKERS = ("math_verify", "numeric", "exact")

_BOXED_RE = re.compile(r"\\(?:boxed|fbox)\s*\{")
_ANSWER_IS_RE = re.compile(r"the answer is\s*:?", re.IGNORECASE)


def _last_boxed(text: str) -> str | None:
    """The contents of the last `\\boxed{...}` whose braces close, else None."""
    for match in reversed(list(_BOXED_RE.finditer(text))):
        depth, start = 1, match.end()
        for at in range(start, len(text)):
            depth += {"{": 1, "}": -1}.get(text[at], 0)
            if depth == 0:
                return text[start:at].strip()
    return None


_SENTENCE_END_RE = re.compile(r"\.(?:\s|$)")


def _rest_of_line(text: str, at: int) -> str:
    """The text from `at` to the end of its line or sentence (a period then a space), `$...$` unwrapped."""
    line = text[at:].split("\n", 1)[0].strip()
    line = _SENTENCE_END_RE.split(line, maxsplit=1)[0].strip()
    if len(line) >= 2 and line.startswith("$") and line.endswith("$"):
        line = line.strip("$").strip()
    return line


def extract_answer(text: str) -> str | None:
    """The final answer written in `text` (module docstring for the order), or None when there is none."""
    boxed = _last_boxed(text)
    if boxed:
        return boxed
    at = text.rfind("####")
    if at >= 0 and _rest_of_line(text, at + 4):
        return _rest_of_line(text, at + 4)
    said = list(_ANSWER_IS_RE.finditer(text))
    if said and _rest_of_line(text, said[-1].end()):
        return _rest_of_line(text, said[-1].end())
    numbers = NUMBER_IN_TEXT_RE.findall(text)
    return numbers[-1] if numbers else None


class ExactChecker:
    """Equal after stripping surrounding whitespace."""

    name = "exact"

    def parse_gold(self, gold: str):
        return gold.strip() or None

    def equal(self, gold, answer: str) -> bool:
        return answer.strip() == gold


class NumericChecker:
    """Equal as exact rationals of plain numbers; an answer that is no number is wrong."""

    name = "numeric"

    def parse_gold(self, gold: str) -> Fraction | None:
        return parse_number(gold)

    def equal(self, gold: Fraction, answer: str) -> bool:
        return parse_number(answer) == gold


class MathVerifyChecker:
    """Symbolic equivalence through `math-verify`. Both sides are read as the contents of a `\\boxed{}`, so
    a bare `\\frac{1}{2}`, `\\dfrac12` or `0.5` parses as LaTeX the way a model's boxed answer does.

    math-verify bounds its parsing and comparison time with SIGALRM, which only the main thread may set;
    prmppo verifies on the main thread of every process, so its default timeouts stand."""

    name = "math_verify"

    def __init__(self) -> None:
        from math_verify import parse, verify  # imported here: only this checker needs sympy and antlr4

        self._parse, self._verify = parse, verify

    def _read(self, text: str) -> list:
        return self._parse("\\boxed{" + text + "}")

    def parse_gold(self, gold: str) -> list | None:
        """The parsed ground truth, or None when math-verify reads no expression in it (it then returns only
        the text it was given, e.g. for an unbalanced `\\frac{1}{`)."""
        parsed = self._read(gold) if gold.strip() else []
        return parsed if any(not isinstance(item, str) for item in parsed) else None

    def equal(self, gold: list, answer: str) -> bool:
        parsed = self._read(answer)
        return bool(parsed) and bool(self._verify(gold, parsed))


def make_checker(name: str):
    """The checker called `name` (one of `CHECKERS`)."""
    if name == "math_verify":
        return MathVerifyChecker()
    if name == "numeric":
        return NumericChecker()
    if name == "exact":
        return ExactChecker()
    raise ValueError(f"task.checker={name!r} is not one of {', '.join(CHECKERS)}")
