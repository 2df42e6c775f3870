"""Chained integer arithmetic evaluated left to right: the maths behind the `arith` task.

A chain "17+5-23*2" means ((17+5)-23)*2; its worked solution writes one line per operator,
each starting from the previous line's result, then the answer line:

    "17+5=22\n22-23=-1\n-1*2=-2\nAnswer: -2"

Everything here is a pure function of ints and strings (no config, no randomness of its own:
`carry_flawed_chain` draws from the generator it is given). `tasks/arith.py` builds the task's
splits, verifier and step checker on top.
"""

from __future__ import annotations

import random
import re
from collections.abc import Sequence

from prmppo.tasks.base import Problem

SUPPORTED_OPERATORS = ("+", "-", "*")
QUESTION_RE = re.compile(r"\d+(?:[+\-*]\d+)+")
ANSWER_PREFIX = "Answer: "


def apply_operator(left: int, operator: str, right: int) -> int:
    """`left operator right` on Python ints (exact; never evaluates text)."""
    if operator == "+":
        return left + right
    if operator == "-":
        return left - right
    if operator == "*":
        return left * right
    raise ValueError(f"unsupported operator {operator!r}; valid operators are {SUPPORTED_OPERATORS}")


def parse_question(question: str) -> tuple[list[int], list[str]]:
    """Operands and operators of a chain question such as "17+5-23*2"."""
    if not QUESTION_RE.fullmatch(question):
        raise ValueError(f"not an arith question (expected e.g. '17+5-23*2'): {question!r}")
    operands = [int(tok) for tok in re.findall(r"\d+", question)]
    operators = re.findall(r"[+\-*]", question)
    return operands, operators


def chain_values(operands: Sequence[int], operators: Sequence[str]) -> list[int]:
    """Running values after each operator, left to right: [v1, ..., v_n_ops]."""
    values, running = [], operands[0]
    for operator, operand in zip(operators, operands[1:]):
        running = apply_operator(running, operator, operand)
        values.append(running)
    return values


def carries(left: int, operator: str, right: int) -> bool:
    """True for an addition whose units digits carry: `left` >= 0 and left % 10 + right % 10 >= 10.

    A negative `left` (a running value below zero) plus a non-negative operand is a subtraction in
    column arithmetic, so it never counts as a carry.
    """
    return operator == "+" and left >= 0 and left % 10 + right % 10 >= 10


def carry_steps(operands: Sequence[int], operators: Sequence[str]) -> int:
    """How many steps of the true chain carry (`carries`), the steps the `carry` SFT flaw can hit."""
    lefts = [operands[0]] + chain_values(operands, operators)[:-1]
    return sum(carries(left, op, right) for left, op, right in zip(lefts, operators, operands[1:]))


def carry_flawed_chain(
    operands: Sequence[int], operators: Sequence[str], rate: float, rng: random.Random
) -> tuple[list[int], tuple[int, ...]]:
    """(written results, 0-based steps written without their carry) of a solver that drops each carry
    with probability `rate`: a step that carries from the *written* previous value draws once from
    `rng`, and every later step starts from the written value."""
    results, flawed, previous = [], [], operands[0]
    for k, (operator, operand) in enumerate(zip(operators, operands[1:])):
        result = apply_operator(previous, operator, operand)
        if carries(previous, operator, operand) and rng.random() < rate:
            result -= 10
            flawed.append(k)
        results.append(result)
        previous = result
    return results, tuple(flawed)


def render_solution(
    operands: Sequence[int], operators: Sequence[str], results: Sequence[int], answer: int
) -> str:
    """Steps "a op b = c" where each a is the previous written result, then the answer line."""
    lines, previous = [], operands[0]
    for operator, operand, result in zip(operators, operands[1:], results):
        lines.append(f"{previous}{operator}{operand}={result}")
        previous = result
    lines.append(f"{ANSWER_PREFIX}{answer}")
    return "\n".join(lines)


def make_problem(operands: Sequence[int], operators: Sequence[str]) -> Problem:
    """The problem for one chain, with its gold worked solution."""
    question = "".join(f"{op}{x}" for op, x in zip(("",) + tuple(operators), operands))
    results = chain_values(operands, operators)
    solution = render_solution(operands, operators, results, results[-1])
    meta = {"operands": tuple(operands), "operators": tuple(operators)}
    return Problem(question=question, solution=solution, answer=str(results[-1]), meta=meta)
