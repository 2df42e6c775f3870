"""Synthetic chained arithmetic: the embedded default task, every step exactly checkable.

A problem is a chain of non-negative integer operands joined by operators, written without
spaces and evaluated strictly left to right with no precedence:

    question  "17+5-23*2"          meaning ((17+5)-23)*2
    prompt    "17+5-23*2\n"
    solution  "17+5=22\n22-23=-1\n-1*2=-2\nAnswer: -2"
    answer    "-2"

Each solution line applies the next operator to the previous result, so the k-th line is
checkable on its own (the chain arithmetic itself: `tasks/chains.py`). Tokens are characters and the format is deliberately terse, because the
default policy is a tiny character-level model trained from scratch on a laptop CPU.

Difficulty knobs (operand count, value range, operators) are set separately for the `sft`
distribution (warm-start worked solutions) and the `rl` distribution (`train` and `test`
prompts), so RL can ask for longer chains than SFT showed.

A flawed warm start (`sft_flaw="carry"`, off by default): in the `sft` split's worked solutions
only, an addition step whose units digits carry is written without the carry (the result minus 10)
with probability `sft_flaw_rate`, and the solution goes on from the written value, as a solver with
one consistent bug would, so its answer line is wrong too. `Problem.answer`, the verifier, the step
checker, `corrupt` and the `train` / `test` splits stay true arithmetic; a `sft` problem's `meta`
lists the steps written wrong (`flawed_steps`). With a rate above 1/2 the warm-started policy's
most likely token at a carry is the wrong one, so greedy decoding and pass@k on prompts with carries
can only rise if RL moves probability to the minority correct variant, which no change of sampling
temperature does.

    sft    "18+5-3\n"  ->  "18+5=13\n13-3=10\nAnswer: 10"   (8+5 carries; the flaw drops it)
    gold                   "18+5=23\n23-3=20\nAnswer: 20"

Simplifications: operands are non-negative (a leading minus in the question would be
ambiguous with subtraction); only "\n" is supported as the step delimiter; no division.

Build it from config with `_target_: prmppo.tasks.arith.ArithTask`, or directly:

    from prmppo.tasks import ArithTask
    task = ArithTask(seed=0)
    problem = task.problems("train")[0]
"""

from __future__ import annotations

import random
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from prmppo.config.schema import ArithTaskConfig
from prmppo.tasks.base import SPLITS, Problem
from prmppo.tasks.chains import (ANSWER_PREFIX, SUPPORTED_OPERATORS, apply_operator, carry_flawed_chain, carry_steps,
                                 chain_values, make_problem, parse_question, render_solution)

SFT_FLAWS = ("none", "carry")
DIFFICULTY_KEYS = ("min_operands", "max_operands", "min_value", "max_value", "operators")

# A written step "<a><op><b>=<c>": a and c may be negative (running values can go below
# zero), b is always a question operand and therefore non-negative.
_STEP_RE = re.compile(r"(-?\d+)([+\-*])(\d+)=(-?\d+)")
_ANSWER_LINE_RE = re.compile(r"Answer:\s*(-?\d+)")
# After the last "Answer:" marker: optional spaces, an integer, then only spaces to line end.
_ANSWER_TAIL_RE = re.compile(r"[ \t]*(-?\d+)[ \t]*(?:\r?\n|$)")


@dataclass(frozen=True)
class Difficulty:
    """One problem distribution: operand count range, operand value range, operators."""

    min_operands: int
    max_operands: int
    min_value: int
    max_value: int
    operators: tuple[str, ...]

    def question_count(self) -> int:
        """How many distinct question strings this distribution can produce."""
        values = self.max_value - self.min_value + 1
        ops = len(set(self.operators))
        return sum(values**n * ops ** (n - 1) for n in range(self.min_operands, self.max_operands + 1))


def _default_difficulty(key: str) -> Difficulty:
    """The schema's default for `task.sft` / `task.rl` (built on each call: nothing shared mutably)."""
    chain = getattr(ArithTaskConfig(), key)
    return Difficulty(chain.min_operands, chain.max_operands, chain.min_value, chain.max_value,
                      tuple(chain.operators))


def _int_knob(key: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"task.{key} must be an integer, got {value!r}")
    return value


def _parse_flaw(flaw: object, rate: object) -> tuple[str, float]:
    """Validate `task.sft_flaw` and `task.sft_flaw_rate` (see the module docstring)."""
    if flaw not in SFT_FLAWS:
        raise ValueError(f"task.sft_flaw must be one of {SFT_FLAWS}, got {flaw!r}")
    if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not 0.0 <= rate <= 1.0:
        raise ValueError(f"task.sft_flaw_rate must be a number in [0, 1], got {rate!r}")
    if flaw == "none" and rate != 0:
        raise ValueError(
            f"task.sft_flaw_rate={rate} has no effect with task.sft_flaw=none; set task.sft_flaw=carry "
            "or task.sft_flaw_rate=0"
        )
    return str(flaw), float(rate)


def parse_difficulty(key: str, spec: Mapping | None) -> Difficulty:
    """Validate one difficulty mapping (`task.sft` or `task.rl`); missing keys take the default."""
    base = _default_difficulty(key)
    if spec is None:
        return base
    if not isinstance(spec, Mapping):
        raise ValueError(f"task.{key} must be a mapping with keys {DIFFICULTY_KEYS}, got {spec!r}")
    unknown = sorted(str(k) for k in spec if k not in DIFFICULTY_KEYS)
    if unknown:
        raise ValueError(f"task.{key} has unknown keys {unknown}; valid keys are {DIFFICULTY_KEYS}")
    merged = {name: spec[name] if name in spec else getattr(base, name) for name in DIFFICULTY_KEYS}
    ints = {name: _int_knob(f"{key}.{name}", merged[name]) for name in DIFFICULTY_KEYS[:4]}
    if ints["min_operands"] < 2:
        raise ValueError(f"task.{key}.min_operands must be >= 2 (a chain needs an operator), got {ints['min_operands']}")
    if ints["min_value"] < 0:
        raise ValueError(f"task.{key}.min_value must be >= 0 (operands are non-negative), got {ints['min_value']}")
    for low, high in (("min_operands", "max_operands"), ("min_value", "max_value")):
        if ints[low] > ints[high]:
            raise ValueError(f"task.{key}.{low} ({ints[low]}) must be <= task.{key}.{high} ({ints[high]})")
    operators = merged["operators"]
    if isinstance(operators, str) or not isinstance(operators, Sequence) or len(operators) == 0:
        raise ValueError(
            f"task.{key}.operators must be a non-empty list drawn from {SUPPORTED_OPERATORS}, got {operators!r}"
        )
    bad = [op for op in operators if op not in SUPPORTED_OPERATORS]
    if bad:
        raise ValueError(f"task.{key}.operators has unsupported {bad}; valid ones are {SUPPORTED_OPERATORS}")
    return Difficulty(operators=tuple(operators), **ints)


class ArithTask:
    """Chained left-to-right integer arithmetic with an exact step checker.

    Step correctness uses first-error (prefix) semantics: the k-th arithmetic line is correct
    iff every earlier line is correct, it applies the question's k-th operator to the true
    running value (which, all earlier lines being correct, is also the previous line's written
    result) and the (k+1)-th operand, and its result is exact. So after the first wrong line
    every later line is wrong, even one that happens to land back on the true value (possible
    after "*0"). PRM labels run up to the first wrong step, which this makes unambiguous, and it
    matches Math-Shepherd's reading of a step (can the correct answer still be reached soundly).
    """

    name = "arith"

    def __init__(
        self,
        seed: int = ArithTaskConfig.seed,
        sft: Mapping | None = None,
        rl: Mapping | None = None,
        sft_size: int = ArithTaskConfig.sft_size,
        train_size: int = ArithTaskConfig.train_size,
        test_size: int = ArithTaskConfig.test_size,
        step_delimiter: str = ArithTaskConfig.step_delimiter,
        sft_flaw: str = ArithTaskConfig.sft_flaw,
        sft_flaw_rate: float = ArithTaskConfig.sft_flaw_rate,
    ) -> None:
        self.seed = _int_knob("seed", seed)
        self.sft_flaw, self.sft_flaw_rate = _parse_flaw(sft_flaw, sft_flaw_rate)
        self.sft = parse_difficulty("sft", sft)
        self.rl = parse_difficulty("rl", rl)
        self.sizes = {
            "sft": _int_knob("sft_size", sft_size),
            "train": _int_knob("train_size", train_size),
            "test": _int_knob("test_size", test_size),
        }
        for split, size in self.sizes.items():
            if size <= 0:
                raise ValueError(f"task.{split}_size must be > 0, got {size}")
        # Test questions are distinct, and train/sft must still find questions outside them.
        room = self.rl.question_count() // 2
        if self.sizes["test"] > room:
            raise ValueError(
                f"task.test_size ({self.sizes['test']}) must be <= half the distinct rl questions ({room}); "
                "widen task.rl (operands, values, operators) or lower task.test_size"
            )
        if step_delimiter != "\n":
            raise ValueError(f"task.step_delimiter must be '\\n' (the only one supported), got {step_delimiter!r}")
        self.step_delimiter = step_delimiter
        self._cache: dict[str, list[Problem]] = {}

    # --- problems -------------------------------------------------------------------------

    def problems(self, split: str) -> list[Problem]:
        """Deterministic problems of `split`; `sft` and `train` never repeat a `test` question."""
        if split not in SPLITS:
            raise ValueError(f"unknown split {split!r}; valid splits are {SPLITS}")
        if split not in self._cache:
            if split == "test":
                self._cache[split] = self._generate("test", self.rl, exclude=frozenset(), distinct=True)
            else:
                test_questions = frozenset(p.question for p in self.problems("test"))
                difficulty = self.sft if split == "sft" else self.rl
                problems = self._generate(split, difficulty, exclude=test_questions, distinct=False)
                # the flaw rewrites solutions only: the same questions as without it, in the same order
                self._cache[split] = self._with_flaw(problems) if split == "sft" else problems
        return list(self._cache[split])

    def _with_flaw(self, problems: list[Problem]) -> list[Problem]:
        """The `sft` problems with `sft_flaw` applied to their solutions (unchanged for "none")."""
        if self.sft_flaw == "none":
            return problems
        flawed = []
        for index, problem in enumerate(problems):
            operands, operators = problem.meta["operands"], problem.meta["operators"]
            # one stream per solution: its draws do not depend on any other solution's carries
            rng = random.Random(f"{self.seed}-sft-flaw-{index}")
            results, steps = carry_flawed_chain(operands, operators, self.sft_flaw_rate, rng)
            solution = render_solution(operands, operators, results, results[-1])
            flawed.append(Problem(problem.question, solution, problem.answer, {**problem.meta, "flawed_steps": steps}))
        return flawed

    def _generate(
        self, split: str, difficulty: Difficulty, exclude: frozenset[str], distinct: bool
    ) -> list[Problem]:
        # A string seed gives each (seed, split) its own stream, independent of global random.
        rng = random.Random(f"{self.seed}-{split}")
        size = self.sizes[split]
        # Rejection sampling must end: a distribution covered by the test set would loop forever.
        max_attempts = 100 * size + 1000
        out: list[Problem] = []
        seen: set[str] = set()
        for _ in range(max_attempts):
            if len(out) == size:
                return out
            n_operands = rng.randint(difficulty.min_operands, difficulty.max_operands)
            operands = [rng.randint(difficulty.min_value, difficulty.max_value) for _ in range(n_operands)]
            operators = [rng.choice(difficulty.operators) for _ in range(n_operands - 1)]
            problem = make_problem(operands, operators)
            if problem.question in exclude or (distinct and problem.question in seen):
                continue
            seen.add(problem.question)
            out.append(problem)
        if len(out) == size:
            return out
        raise ValueError(
            f"could not draw {size} {split} problems outside the test set in {max_attempts} attempts "
            f"(got {len(out)}); widen task.{'sft' if split == 'sft' else 'rl'} or lower task.{split}_size"
        )

    # --- text ---------------------------------------------------------------------------

    def format_prompt(self, problem: Problem) -> str:
        """The question then a newline; the solution's first step follows directly."""
        return problem.question + "\n"

    def extract_answer(self, response: str) -> str | None:
        """The integer after the last "Answer:", normalised ("007" -> "7", "-0" -> "0"), else None."""
        marker = response.rfind("Answer:")
        if marker < 0:
            return None
        match = _ANSWER_TAIL_RE.match(response, marker + len("Answer:"))
        return str(int(match.group(1))) if match else None

    def verify(self, problem: Problem, response: str) -> bool:
        """True iff the response's final answer equals the gold answer."""
        answer = self.extract_answer(response)
        return answer is not None and answer == problem.answer

    def split_steps(self, response: str) -> list[str]:
        """Lines of the response, stripped, empty lines dropped (the answer line is a step)."""
        return [line.strip() for line in response.split(self.step_delimiter) if line.strip()]

    def difficulty(self, problem: Problem) -> dict[str, int]:
        """`{"operands": n, "carries": c}`: the chain's length, the knob the task's difficulty ranges set,
        and how many steps of the true chain carry in the units digit (`carry_steps`), the steps the
        `carry` SFT flaw teaches the policy to get wrong."""
        operands, operators = parse_question(problem.question)
        return {"operands": len(operands), "carries": carry_steps(operands, operators)}

    # --- steps --------------------------------------------------------------------------

    def check_steps(self, problem: Problem, response: str) -> list[bool]:
        """Per-step correctness with first-error semantics (see the class docstring)."""
        operands, operators = parse_question(problem.question)
        true_values = chain_values(operands, operators)
        labels: list[bool] = []
        n_arith = 0  # arithmetic lines seen so far, right or wrong
        all_correct = True
        for line in self.split_steps(response):
            step = _STEP_RE.fullmatch(line)
            answer = _ANSWER_LINE_RE.fullmatch(line)
            if step:
                ok = all_correct and self._step_is_right(step, n_arith, operands, operators, true_values)
                n_arith += 1
            elif answer:
                ok = all_correct and n_arith == len(operators) and int(answer.group(1)) == int(problem.answer)
            else:
                ok = False
            all_correct = all_correct and ok
            labels.append(ok)
        return labels

    @staticmethod
    def _step_is_right(
        step: re.Match, k: int, operands: list[int], operators: list[str], true_values: list[int]
    ) -> bool:
        if k >= len(operators):
            return False  # an extra arithmetic line beyond the chain
        left, operator, right, result = step.groups()
        left, right, result = int(left), int(right), int(result)
        expected_left = operands[0] if k == 0 else true_values[k - 1]
        return (
            left == expected_left
            and operator == operators[k]
            and right == operands[k + 1]
            and result == apply_operator(left, operator, right)
        )

    def corrupt(self, problem: Problem, position: int, rng: random.Random) -> str:
        """Gold solution with arithmetic step `position` given a wrong result, later steps redone from it.

        The chain stays self-consistent after the error, so it looks plausible and its final
        answer differs from the gold one. Where no offset can change the final value (a later
        "*0" absorbs any error) the answer line is given a wrong number directly.
        """
        operands, operators = parse_question(problem.question)
        if not 0 <= position < len(operators):
            raise ValueError(
                f"corrupt position {position} out of range for {problem.question!r}: "
                f"valid positions are 0..{len(operators) - 1}"
            )
        gold = chain_values(operands, operators)
        offsets = [d for d in range(-9, 10) if d != 0]
        rng.shuffle(offsets)
        for offset in offsets:
            results = self._chain_from(gold, operands, operators, position, gold[position] + offset)
            if results[-1] != gold[-1]:
                return render_solution(operands, operators, results, results[-1])
        results = self._chain_from(gold, operands, operators, position, gold[position] + offsets[0])
        return render_solution(operands, operators, results, gold[-1] + offsets[0])

    @staticmethod
    def _chain_from(
        gold: list[int], operands: list[int], operators: list[str], position: int, wrong: int
    ) -> list[int]:
        results = gold[:position] + [wrong]
        for operator, operand in zip(operators[position + 1 :], operands[position + 2 :]):
            results.append(apply_operator(results[-1], operator, operand))
        return results

    def alphabet(self) -> str:
        """Digits, "+-*=", newline and the letters of "Answer: ", whatever operators are configured.

        A fixed set keeps one vocabulary across difficulty settings, so a checkpoint trained on
        one configuration can be used with another.
        """
        return "".join(sorted(set("0123456789+-*=\n" + ANSWER_PREFIX)))
