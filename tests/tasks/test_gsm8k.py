"""GSM8KTask: parsing the real files, number normalisation, verifier, corruption, malformed input."""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

import pytest

from prmppo.tasks import GSM8KTask, Task
from prmppo.tasks.gsm8k import normalize_number

# The shared data folder sits beside the repository (../shared/data/gsm8k); override with
# PRMPPO_GSM8K_DIR when the checkout lives elsewhere.
DATA_DIR = Path(os.environ.get("PRMPPO_GSM8K_DIR", Path(__file__).resolve().parents[3] / "shared/data/gsm8k"))
needs_data = pytest.mark.skipif(not (DATA_DIR / "test.jsonl").is_file(), reason=f"GSM8K data not at {DATA_DIR}")

JANET_SOLUTION = (
    "Janet sells 16 - 3 - 4 = 9 duck eggs a day.\n"
    "She makes 9 * 2 = $18 every day at the farmer\u2019s market.\n"
    "Answer: 18"
)


@pytest.fixture(scope="module")
def task() -> GSM8KTask:
    return GSM8KTask(str(DATA_DIR))


@needs_data
@pytest.mark.parametrize("split, rows", [("train", 7473), ("test", 1319)])
def test_every_row_has_a_gold_number(task, split, rows):
    problems = task.problems(split)
    assert len(problems) == rows
    for problem in problems:
        assert normalize_number(problem.answer) == problem.answer
        assert problem.solution.split("\n")[-1] == f"Answer: {problem.answer}"
        assert "<<" not in problem.solution and "####" not in problem.solution
        assert task.verify(problem, problem.solution)


@needs_data
def test_first_test_row_is_janets_ducks(task):
    problem = task.problems("test")[0]
    assert problem.question.startswith("Janet\u2019s ducks lay 16 eggs per day.")
    assert problem.solution == JANET_SOLUTION
    assert problem.answer == "18"
    assert problem.meta["line"] == 1 and problem.meta["raw_answer"].endswith("#### 18")
    assert task.format_prompt(problem) == f"Question: {problem.question}\nAnswer:\n"
    assert task.check_steps(problem, problem.solution) is None
    assert task.difficulty(problem) == {"gold_steps": 2}  # two reasoning lines, then the answer line
    assert isinstance(task, Task) and task.name == "gsm8k"


@needs_data
def test_comma_answers_are_normalised(task):
    # Test row 3 (Josh's house) ends with "#### 70000"; a train row ends with "#### 1,200".
    assert task.problems("test")[2].answer == "70000"
    assert "1200" in {p.answer for p in task.problems("train")}
    assert not any("," in p.answer for p in task.problems("train"))


@needs_data
def test_splits_and_test_size():
    sized = GSM8KTask(str(DATA_DIR), test_size=5)
    assert [p.meta["line"] for p in sized.problems("test")] == [1, 2, 3, 4, 5]
    assert sized.problems("sft") == sized.problems("train")
    with pytest.raises(ValueError, match="task.test_size"):
        GSM8KTask(str(DATA_DIR), test_size=2000).problems("test")
    with pytest.raises(ValueError, match="valid splits are"):
        sized.problems("dev")


@pytest.mark.parametrize(
    "text, expected",
    [
        ("12.0", "12"),
        ("1,000", "1000"),
        ("$5", "5"),
        ("-3", "-3"),
        ("0.50", "0.5"),
        ("$18.", "18"),
        (" 2,520,000 ", "2520000"),
        ("-0", "0"),
        (".25", "0.25"),
        ("1/2", "0.5"),
        ("1/3", "1/3"),
        ("twelve", None),
        ("", None),
        ("1e5", None),
        ("2+2", None),
    ],
)
def test_normalize_number(text, expected):
    assert normalize_number(text) == expected


@pytest.mark.parametrize(
    "response, expected",
    [
        ("She has 16-3-4=9 eggs.\nShe makes 9*2=18 dollars.\nAnswer: $18", "18"),
        ("It costs 5.\nAnswer: $1,000.\nThat is all 7", "1000"),  # the marker beats the last number
        ("So 4+5=9\n#### 42", "42"),
        ("So she has 16-3", "3"),  # a minus after a digit is subtraction, not a sign
        ("The total is -4 degrees", "-4"),
        ("Answer: 18.00", "18"),
        ("Answer: none", None),
        ("no numbers here", None),
    ],
)
def test_extract_answer(task, response, expected):
    assert task.extract_answer(response) == expected


@needs_data
def test_verify_model_like_text(task):
    janet = task.problems("test")[0]
    assert task.verify(janet, "She keeps 16 - 3 - 4 = 9 eggs.\nShe earns 9 * 2 = $18.\nAnswer: $18.00")
    assert task.verify(janet, "9*2=18\n#### 18")
    assert not task.verify(janet, "She keeps 16 - 3 = 13 eggs.\nAnswer: 26")
    assert not task.verify(janet, "She earns 18 dollars.\nAnswer:")  # marker without a number


@needs_data
def test_corrupt_changes_one_step_and_the_answer(task):
    janet = task.problems("test")[0]
    gold_steps = janet.solution.split("\n")
    for position in (0, 1):
        lines = task.corrupt(janet, position, random.Random(position)).split("\n")
        assert len(lines) == 3
        assert [line for k, line in enumerate(lines[:2]) if k != position] == [
            line for k, line in enumerate(gold_steps[:2]) if k != position
        ]
        assert lines[position] != gold_steps[position]
        assert not task.verify(janet, "\n".join(lines))
    # Step 0's last number is the 9 (eggs): only it may change.
    step0 = task.corrupt(janet, 0, random.Random(0)).split("\n")[0]
    assert step0.startswith("Janet sells 16 - 3 - 4 = ") and step0.endswith(" duck eggs a day.")
    with pytest.raises(ValueError, match=r"0\.\.1"):
        task.corrupt(janet, 2, random.Random(0))


@needs_data
def test_alphabet_covers_prompts_and_solutions(task):
    alphabet = task.alphabet()
    assert alphabet == "".join(sorted(set(alphabet)))
    for problem in task.problems("test")[:100]:
        assert set(task.format_prompt(problem) + problem.solution) <= set(alphabet)
    assert "\u2019" in alphabet and "<" in alphabet  # curly apostrophe; "<" occurs in questions


def _write(path: Path, lines: list[str]) -> Path:
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


GOOD_ROW = json.dumps({"question": "1+1?", "answer": "1+1=<<1+1=2>>2\n#### 2"})


@pytest.mark.parametrize(
    "bad_line, line_no, what",
    [
        ('{"question": "q", "answer": ', 3, "bad JSON"),
        (json.dumps({"question": "q", "answer": "2+2=4"}), 3, "####"),
        (json.dumps({"question": "q"}), 3, "'answer'"),
        (json.dumps({"question": 7, "answer": "#### 7"}), 3, "'question'"),
        (json.dumps({"question": "q", "answer": "x\n#### seven"}), 3, "seven"),
    ],
)
def test_malformed_rows_name_file_and_line(tmp_path, bad_line, line_no, what):
    # Line 2 is blank and skipped, but line numbers still count it.
    _write(tmp_path / "bad.jsonl", [GOOD_ROW, "", bad_line, GOOD_ROW])
    with pytest.raises(ValueError) as error:
        GSM8KTask(str(tmp_path), train_file="bad.jsonl").problems("train")
    message = str(error.value)
    assert "bad.jsonl" in message and f"line {line_no}" in message and what in message


def test_small_file_parses(tmp_path):
    _write(tmp_path / "train.jsonl", [GOOD_ROW, "", GOOD_ROW])
    problems = GSM8KTask(str(tmp_path)).problems("sft")
    assert [p.meta["line"] for p in problems] == [1, 3]
    assert problems[0].solution == "1+1=2\nAnswer: 2" and problems[0].answer == "2"


def test_missing_file_names_path_and_key(tmp_path):
    with pytest.raises(FileNotFoundError) as error:
        GSM8KTask(str(tmp_path)).problems("test")
    assert str(tmp_path / "test.jsonl") in str(error.value) and "task.data_dir" in str(error.value)


def test_relative_data_dir_resolves_against_cwd(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert GSM8KTask("data").data_dir == tmp_path / "data"


def test_bad_knobs():
    with pytest.raises(ValueError, match="task.test_size"):
        GSM8KTask("x", test_size=0)
    with pytest.raises(ValueError, match="task.step_delimiter"):
        GSM8KTask("x", step_delimiter="\n\n")
