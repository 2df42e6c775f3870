"""ArithTask's SFT flaw (`sft_flaw=carry`) and its difficulty counts, against hand-worked chains.

The flaw must reach the `sft` split's worked solutions and nothing else: the answer, the verifier, the
step checker, `corrupt`, the `train` / `test` splits and the verifier receipt stay true arithmetic.
"""

from __future__ import annotations

import random
import re

import pytest

from prmppo.config.schema import ArithTaskConfig
from prmppo.guards.gates import verifier_receipt
from prmppo.tasks import ArithTask
from prmppo.tasks.chains import apply_operator, carries, carry_flawed_chain, carry_steps, make_problem

SMALL = dict(sft_size=2000, train_size=300, test_size=100)
RATE = 0.7
_STEP = re.compile(r"(-?\d+)([+\-*])(\d+)=(-?\d+)")


@pytest.fixture(scope="module")
def flawed() -> ArithTask:
    return ArithTask(seed=0, sft_flaw="carry", sft_flaw_rate=RATE, **SMALL)


@pytest.fixture(scope="module")
def plain() -> ArithTask:
    return ArithTask(seed=0, **SMALL)


def written_steps(solution: str) -> list[tuple[int, str, int, int]]:
    return [(int(a), op, int(b), int(c)) for a, op, b, c in
            (_STEP.fullmatch(line).groups() for line in solution.split("\n")[:-1])]


@pytest.mark.parametrize("left, operator, right, expected", [
    (29, "+", 3, True),    # 9 + 3 = 12
    (32, "+", 8, True),    # 2 + 8 = 10: a carry of exactly ten
    (21, "+", 8, False),   # 1 + 8 = 9
    (95, "+", 7, True),    # into the hundreds
    (29, "-", 3, False),   # only additions carry
    (-5, "+", 15, False),  # a negative running value plus an operand is a column subtraction
    (0, "+", 0, False),
])
def test_carries_by_hand(left, operator, right, expected):
    assert carries(left, operator, right) is expected


def test_difficulty_counts_operands_and_true_carries(plain):
    # 29+3=32 (carries), 32+8=40 (carries), 40-5=35: two carries in four operands
    assert plain.difficulty(make_problem([29, 3, 8, 5], ["+", "+", "-"])) == {"operands": 4, "carries": 2}
    # 0-5=-5, -5+15=10 (no carry from a negative value), 10+9=19 (0+9): none
    assert plain.difficulty(make_problem([0, 5, 15, 9], ["-", "+", "+"])) == {"operands": 4, "carries": 0}
    assert carry_steps([29, 3, 8, 5], ["+", "+", "-"]) == 2


def test_flawed_chain_by_hand():
    # 29+3+8-5 with every carry dropped: 29+3=22 (not 32), then 22+8=30 carries again from the written 22
    # (2+8) and is written 20; 20-5=15. The true chain is 32, 40, 35.
    results, steps = carry_flawed_chain([29, 3, 8, 5], ["+", "+", "-"], 1.0, random.Random(0))
    assert (results, steps) == ([22, 20, 15], (0, 1))
    assert carry_flawed_chain([29, 3, 8, 5], ["+", "+", "-"], 0.0, random.Random(0)) == ([32, 40, 35], ())


def test_default_is_off_and_leaves_the_sft_text_unchanged(plain):
    assert (ArithTaskConfig().sft_flaw, ArithTaskConfig().sft_flaw_rate) == ("none", 0.0)
    for problem in plain.problems("sft"):
        assert problem.solution == make_problem(problem.meta["operands"], problem.meta["operators"]).solution
        assert "flawed_steps" not in problem.meta


def test_the_flaw_keeps_the_questions_and_answers(flawed, plain):
    assert [p.question for p in flawed.problems("sft")] == [p.question for p in plain.problems("sft")]
    assert [p.answer for p in flawed.problems("sft")] == [p.answer for p in plain.problems("sft")]
    assert flawed.problems("sft") == ArithTask(seed=0, sft_flaw="carry", sft_flaw_rate=RATE, **SMALL).problems("sft")
    assert [p.solution for p in flawed.problems("sft")] != \
        [p.solution for p in ArithTask(seed=1, sft_flaw="carry", sft_flaw_rate=RATE, **SMALL).problems("sft")]


def test_flawed_text_differs_exactly_at_carry_steps_at_the_rate(flawed):
    carrying = dropped = 0
    for problem in flawed.problems("sft"):
        operands, operators = problem.meta["operands"], problem.meta["operators"]
        previous = operands[0]
        for k, (left, operator, right, result) in enumerate(written_steps(problem.solution)):
            # each line continues from the written value and applies the question's operator and operand
            assert (left, operator, right) == (previous, operators[k], operands[k + 1])
            true_result = apply_operator(left, operator, right)
            if k in problem.meta["flawed_steps"]:
                assert carries(left, operator, right) and result == true_result - 10
            else:
                assert result == true_result
            carrying += carries(left, operator, right)
            previous = result
        dropped += len(problem.meta["flawed_steps"])
        assert problem.solution.split("\n")[-1] == f"Answer: {previous}"
    # a binomial(carrying, 0.7) count: with ~900 carrying steps its sd is ~0.015, so 0.06 is 4 sd
    assert carrying > 500 and abs(dropped / carrying - RATE) < 0.06


def test_checker_and_verifier_mark_flawed_solutions_wrong(flawed):
    n_flawed = 0
    for problem in flawed.problems("sft"):
        labels = flawed.check_steps(problem, problem.solution)
        if not problem.meta["flawed_steps"]:
            assert labels == [True] * len(labels) and flawed.verify(problem, problem.solution)
            continue
        n_flawed += 1
        first = problem.meta["flawed_steps"][0]
        assert labels == [True] * first + [False] * (len(labels) - first)
        # "+" and "-" only: a dropped ten is never absorbed, so the answer line is wrong
        assert not flawed.verify(problem, problem.solution)
    assert n_flawed > 300


def test_every_other_solution_stays_gold(flawed, plain):
    for split in ("train", "test"):
        assert flawed.problems(split) == plain.problems(split)
        assert [p.solution for p in flawed.problems(split)] == [p.solution for p in plain.problems(split)]
        for problem in flawed.problems(split)[:100]:
            assert flawed.check_steps(problem, problem.solution) == [True] * len(flawed.split_steps(problem.solution))
    problem = flawed.problems("test")[0]
    assert flawed.corrupt(problem, 0, random.Random(0)) == plain.corrupt(problem, 0, random.Random(0))
    receipt = verifier_receipt(flawed, n=100)
    assert receipt["gold_pass_rate"] == 1.0 and receipt["corrupted_pass_rate"] == 0.0


def test_rate_one_drops_every_carry_and_rate_zero_none():
    always = ArithTask(seed=0, sft_flaw="carry", sft_flaw_rate=1.0, sft_size=300, train_size=10, test_size=10)
    never = ArithTask(seed=0, sft_flaw="carry", sft_flaw_rate=0.0, sft_size=300, train_size=10, test_size=10)
    plain = ArithTask(seed=0, sft_size=300, train_size=10, test_size=10)
    for problem in always.problems("sft"):
        assert not any(carries(a, op, b) and c == a + b for a, op, b, c in written_steps(problem.solution))
    assert [p.solution for p in never.problems("sft")] == [p.solution for p in plain.problems("sft")]


@pytest.mark.parametrize("kwargs, key", [
    ({"sft_flaw": "borrow"}, "task.sft_flaw"),
    ({"sft_flaw": "carry", "sft_flaw_rate": 1.5}, "task.sft_flaw_rate"),
    ({"sft_flaw": "carry", "sft_flaw_rate": -0.1}, "task.sft_flaw_rate"),
    ({"sft_flaw": "carry", "sft_flaw_rate": True}, "task.sft_flaw_rate"),
    ({"sft_flaw_rate": 0.7}, "task.sft_flaw_rate"),  # a rate without a flaw would silently do nothing
])
def test_bad_flaw_knobs_name_the_key(kwargs, key):
    with pytest.raises(ValueError, match=re.escape(key)):
        ArithTask(**kwargs)
