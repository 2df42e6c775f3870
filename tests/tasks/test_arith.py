"""ArithTask: generation, format, verifier, exact step checker and corruption, against hand-worked chains."""

from __future__ import annotations

import random
import re
from types import MappingProxyType

import pytest

from prmppo.tasks import SPLITS, ArithTask, Problem, Task
from prmppo.tasks.arith import make_problem

# 17+5-23*2 left to right: 17+5=22, 22-23=-1, -1*2=-2.
GOLD = "17+5=22\n22-23=-1\n-1*2=-2\nAnswer: -2"
SMALL = dict(sft_size=300, train_size=300, test_size=50)


@pytest.fixture(scope="module")
def task() -> ArithTask:
    return ArithTask(seed=0, **SMALL)


@pytest.fixture(scope="module")
def chain() -> Problem:
    return make_problem([17, 5, 23, 2], ["+", "-", "*"])


def test_problem_format_is_exact(task, chain):
    assert chain.question == "17+5-23*2"
    assert chain.solution == GOLD
    assert chain.answer == "-2"
    assert task.format_prompt(chain) == "17+5-23*2\n"
    assert chain.meta == {"operands": (17, 5, 23, 2), "operators": ("+", "-", "*")}
    assert isinstance(task, Task) and task.name == "arith"


def test_negative_running_values_are_written_as_is():
    # 0-5=-5, -5-3=-8, -8+10=2
    assert make_problem([0, 5, 3, 10], ["-", "-", "+"]).solution == "0-5=-5\n-5-3=-8\n-8+10=2\nAnswer: 2"


def test_same_seed_same_problems_other_seed_differs():
    first, again, other = ArithTask(seed=0, **SMALL), ArithTask(seed=0, **SMALL), ArithTask(seed=1, **SMALL)
    for split in SPLITS:
        assert first.problems(split) == again.problems(split)
        assert first.problems(split) != other.problems(split)


def test_splits_have_their_own_streams(task):
    # Same rl distribution, different (seed, split) stream: train must not replay test.
    assert [p.question for p in task.problems("train")[:50]] != [p.question for p in task.problems("test")]


def test_test_is_distinct_and_disjoint_from_train_and_sft():
    # 3 operands in 0..3 with "+" only: 4**3 = 64 questions, so 300 draws would surely hit
    # the 25 test questions without the exclusion.
    tiny = {"min_operands": 3, "max_operands": 3, "min_value": 0, "max_value": 3, "operators": ["+"]}
    t = ArithTask(seed=0, sft=tiny, rl=tiny, sft_size=300, train_size=300, test_size=25)
    test_questions = [p.question for p in t.problems("test")]
    assert len(set(test_questions)) == 25
    assert not set(test_questions) & {p.question for p in t.problems("train")}
    assert not set(test_questions) & {p.question for p in t.problems("sft")}
    assert len(t.problems("train")) == 300


def test_operand_counts_follow_each_distribution(task):
    def shape(split):
        counts = {len(p.meta["operands"]) for p in task.problems(split)}
        values = {v for p in task.problems(split) for v in p.meta["operands"]}
        return counts, values

    # Defaults (the schema's, as a run gets them): sft draws 2..5 operands, rl (train and test) 3..5,
    # all values in 0..30.
    sft_counts, sft_values = shape("sft")
    train_counts, train_values = shape("train")
    test_counts, test_values = shape("test")
    assert sft_counts == {2, 3, 4, 5}
    assert train_counts == {3, 4, 5} and test_counts <= {3, 4, 5}
    assert min(sft_values) == 0 and max(sft_values) == 30
    assert min(train_values | test_values) >= 0 and max(train_values | test_values) <= 30


def test_default_sizes_and_mapping_like_knobs():
    t = ArithTask()
    assert [len(t.problems(s)) for s in SPLITS] == [20000, 20000, 200]
    ops = MappingProxyType({"operators": ("*",), "max_value": 5})
    only_mul = ArithTask(rl=ops, test_size=10, train_size=10)
    assert all(set(p.meta["operators"]) == {"*"} for p in only_mul.problems("train"))
    assert all(max(p.meta["operands"]) <= 5 for p in only_mul.problems("train"))


def test_hydra_config_containers_are_accepted():
    omegaconf = pytest.importorskip("omegaconf")
    cfg = omegaconf.OmegaConf.create({"min_operands": 2, "max_operands": 2, "min_value": 1, "max_value": 9,
                                      "operators": ["-"]})
    t = ArithTask(sft=cfg, rl=cfg, sft_size=5, train_size=5, test_size=5)
    assert all(re.fullmatch(r"[1-9]-[1-9]", p.question) for p in t.problems("sft"))


def test_gold_solutions_pass_for_200_problems(task):
    for problem in (task.problems("train")[:100] + task.problems("sft")[:100]):
        steps = task.split_steps(problem.solution)
        assert task.check_steps(problem, problem.solution) == [True] * len(steps)
        assert len(steps) == len(problem.meta["operators"]) + 1
        assert task.verify(problem, problem.solution)


@pytest.mark.parametrize(
    "response, labels, verified",
    [
        (GOLD, [True, True, True, True], True),
        # step 1 result wrong (17+5 is 22); later steps continue from 23, so they are wrong too
        ("17+5=23\n23-23=0\n0*2=0\nAnswer: 0", [False, False, False, False], False),
        # step 2 result wrong (22-23 is -1)
        ("17+5=22\n22-23=1\n1*2=2\nAnswer: 2", [True, False, False, False], False),
        # inconsistent: step 2 starts from 23, not the previous result 22
        ("17+5=22\n23-23=0\n0*2=0\nAnswer: 0", [True, False, False, False], False),
        # wrong operand (24 instead of 23), arithmetic itself right
        ("17+5=22\n22-24=-2\n-2*2=-4\nAnswer: -4", [True, False, False, False], False),
        # wrong operator (+ instead of -)
        ("17+5=22\n22+23=45\n45*2=90\nAnswer: 90", [True, False, False, False], False),
        # all steps right, final answer wrong
        ("17+5=22\n22-23=-1\n-1*2=-2\nAnswer: -3", [True, True, True, False], False),
        # missing answer line
        ("17+5=22\n22-23=-1\n-1*2=-2", [True, True, True], False),
        # garbage line: wrong, and first-error semantics make every later line wrong
        ("17+5=22\nhmm\n22-23=-1\n-1*2=-2\nAnswer: -2", [True, False, False, False, False], True),
        # extra arithmetic line beyond the chain
        ("17+5=22\n22-23=-1\n-1*2=-2\n-2+0=-2\nAnswer: -2", [True, True, True, False, False], True),
        # right answer but steps missing
        ("17+5=22\nAnswer: -2", [True, False], True),
        # surrounding spaces and blank lines do not count as steps
        ("  17+5=22 \n\n22-23=-1\n\n-1*2=-2\nAnswer:-2\n", [True, True, True, True], True),
    ],
)
def test_hand_worked_step_labels(task, chain, response, labels, verified):
    assert task.check_steps(chain, response) == labels
    assert task.verify(chain, response) is verified


def test_step_after_an_error_that_lands_on_the_true_value_is_still_wrong(task):
    # 3+4*0+5: true values 7, 0, 5. Writing 3+4=8 is wrong; 8*0=0 and 0+5=5 reach the true
    # values again but build on the error, so first-error semantics mark them wrong.
    problem = make_problem([3, 4, 0, 5], ["+", "*", "+"])
    assert task.check_steps(problem, "3+4=8\n8*0=0\n0+5=5\nAnswer: 5") == [False] * 4


def test_missing_answer_line_has_no_answer(task, chain):
    assert task.extract_answer("17+5=22\n22-23=-1\n-1*2=-2") is None


@pytest.mark.parametrize(
    "response, expected",
    [
        ("Answer: 007", "7"),
        ("Answer: -0", "0"),
        ("Answer:-5", "-5"),
        ("x\nAnswer:   12  \n", "12"),
        ("Answer: 1\nAnswer: 2", "2"),
        ("Answer: 2\nAnswer: x", None),  # the last marker governs
        ("Answer: 1.5", None),
        ("Answer: 12abc", None),
        ("the answer is 4", None),
    ],
)
def test_extract_answer(task, response, expected):
    assert task.extract_answer(response) == expected


def _assert_consistent_chain(problem, corrupted, position):
    """Every written step a op b = c is arithmetically right and continues the previous c."""
    lines = corrupted.split("\n")
    previous = problem.meta["operands"][0]
    for k, line in enumerate(lines[:-1]):
        a, op, b, c = re.fullmatch(r"(-?\d+)([+\-*])(\d+)=(-?\d+)", line).groups()
        assert int(a) == previous and int(b) == problem.meta["operands"][k + 1]
        if k != position:
            assert int(c) == {"+": int(a) + int(b), "-": int(a) - int(b), "*": int(a) * int(b)}[op]
        previous = int(c)
    assert lines[-1] == f"Answer: {previous}"


def test_corrupt_every_position(task):
    rng = random.Random(0)
    for problem in task.problems("test")[:30]:
        n_ops = len(problem.meta["operators"])
        for position in range(n_ops):
            corrupted = task.corrupt(problem, position, rng)
            assert task.check_steps(problem, corrupted) == [True] * position + [False] * (n_ops + 1 - position)
            assert not task.verify(problem, corrupted)
            _assert_consistent_chain(problem, corrupted, position)


def test_corrupt_when_a_later_times_zero_absorbs_the_error(task):
    # 3+4*0+5 = 5 whatever step 0 says, so the answer line itself must be made wrong.
    problem = make_problem([3, 4, 0, 5], ["+", "*", "+"])
    corrupted = task.corrupt(problem, 0, random.Random(0))
    assert task.check_steps(problem, corrupted) == [False] * 4
    assert not task.verify(problem, corrupted)
    assert task.check_steps(problem, task.corrupt(problem, 2, random.Random(0))) == [True, True, False, False]


@pytest.mark.parametrize("position", [-1, 3])
def test_corrupt_position_out_of_range(task, chain, position):
    with pytest.raises(ValueError, match=r"0\.\.2"):
        task.corrupt(chain, position, random.Random(0))


def test_alphabet_covers_every_prompt_and_solution(task):
    alphabet = task.alphabet()
    assert alphabet == "".join(sorted(set(alphabet)))
    assert set(alphabet) == set("0123456789+-*=\nAnswer: ")
    for problem in task.problems("sft")[:50] + task.problems("test"):
        assert set(task.format_prompt(problem) + problem.solution) <= set(alphabet)


def test_unknown_split(task):
    with pytest.raises(ValueError, match="valid splits are"):
        task.problems("validation")


@pytest.mark.parametrize(
    "kwargs, key",
    [
        ({"sft": {"min_operands": 1}}, "task.sft.min_operands"),
        ({"rl": {"min_operands": 4, "max_operands": 3}}, "task.rl.min_operands"),
        ({"rl": {"min_value": 9, "max_value": 3}}, "task.rl.min_value"),
        ({"rl": {"min_value": -1}}, "task.rl.min_value"),
        ({"sft": {"operators": ["+", "/"]}}, "task.sft.operators"),
        ({"sft": {"operators": []}}, "task.sft.operators"),
        ({"sft": {"max_oprands": 3}}, "task.sft"),
        ({"rl": {"max_value": 2.5}}, "task.rl.max_value"),
        ({"sft_size": 0}, "task.sft_size"),
        ({"train_size": -5}, "task.train_size"),
        ({"test_size": 0}, "task.test_size"),
        ({"step_delimiter": ";"}, "task.step_delimiter"),
        # 2 operands in 0..1 with "+": 4 questions, so at most 2 may be held out for test
        ({"rl": {"min_operands": 2, "max_operands": 2, "max_value": 1, "operators": ["+"]}, "test_size": 3},
         "task.test_size"),
    ],
)
def test_bad_knobs_name_the_key(kwargs, key):
    with pytest.raises(ValueError, match=re.escape(key)):
        ArithTask(**kwargs)
