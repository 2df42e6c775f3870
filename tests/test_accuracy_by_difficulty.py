"""scripts/accuracy_by_difficulty.py: greedy, sampled and pass@k per difficulty value, from per-problem outcomes."""

from __future__ import annotations

import importlib.util
import json

import pytest

from conftest import REPO

spec = importlib.util.spec_from_file_location("accuracy_by_difficulty", REPO / "scripts" / "accuracy_by_difficulty.py")
by_difficulty = importlib.util.module_from_spec(spec)
spec.loader.exec_module(by_difficulty)


def row(operands: int, carries: int, greedy: bool, right_of_4: int) -> dict:
    return {"difficulty": {"operands": operands, "carries": carries}, "greedy_correct": greedy,
            "correct_of_k": right_of_4, "k": 4}


def test_tables_by_hand():
    rows = [row(3, 0, True, 4), row(3, 1, False, 1), row(4, 1, False, 0), row(4, 2, True, 2)]
    table = by_difficulty.by_difficulty(rows)
    # all: greedy 2/4; sampled (4 + 1 + 0 + 2) / 16; pass@4 = problems with a right sample, 3/4
    assert table["all"] == {"problems": 4, "greedy": 0.5, "sampled": 7 / 16, "pass@4": 0.75}
    # carries=1: the 2nd and 3rd rows, greedy 0/2, sampled 1/8, pass@4 1/2
    assert table["carries=1"] == {"problems": 2, "greedy": 0.0, "sampled": 1 / 8, "pass@4": 0.5}
    assert table["operands=4"] == {"problems": 2, "greedy": 0.5, "sampled": 2 / 8, "pass@4": 0.5}
    assert list(table) == ["all", "carries=0", "carries=1", "carries=2", "operands=3", "operands=4"]


def test_a_run_dir_is_read_from_its_eval_json_with_the_rebuilt_tasks_difficulty(tmp_path):
    from prmppo.tasks import ArithTask

    task = ArithTask(seed=0, sft_size=10, train_size=10, test_size=3)
    (tmp_path / ".hydra").mkdir()
    (tmp_path / ".hydra" / "config.yaml").write_text(
        "task:\n  _target_: prmppo.tasks.arith.ArithTask\n  seed: 0\n  sft_size: 10\n  train_size: 10\n  test_size: 3\n")
    # rows written without a difficulty: the script gives each its problem's, found by index
    rows = [{"index": i, "greedy_correct": i == 0, "correct_of_k": i, "k": 2} for i in range(3)]
    (tmp_path / "eval.json").write_text(json.dumps({"sft": {"problems": rows}, "delta": {"greedy_accuracy": 0.0}}))
    outcomes = by_difficulty.outcomes_of_run(tmp_path)
    assert list(outcomes) == ["sft"]
    assert [r["difficulty"] for r in outcomes["sft"]] == [task.difficulty(p) for p in task.problems("test")]
    assert by_difficulty.by_difficulty(outcomes["sft"])["all"]["pass@2"] == pytest.approx(2 / 3)


def test_a_run_without_per_problem_outcomes_is_refused_with_the_way_out(tmp_path):
    (tmp_path / ".hydra").mkdir()
    (tmp_path / ".hydra" / "config.yaml").write_text("task:\n  _target_: prmppo.tasks.arith.ArithTask\n  test_size: 3\n")
    (tmp_path / "eval.json").write_text(json.dumps({"sft": {"greedy_accuracy": 0.5}}))
    with pytest.raises(SystemExit, match="CHECKPOINT_DIR"):
        by_difficulty.outcomes_of_run(tmp_path)
