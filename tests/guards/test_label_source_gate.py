"""The PRM-label gate: `prm_train.label_source=checker` on a task without an exact step checker is refused
before SFT or any weights, by the gate itself and by every stage that trains a PRM."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from prmppo.app import run
from prmppo.guards.gates import GateError, check_label_source
from prmppo.tasks import ArithTask
from prmppo.tasks.gsm8k import GSM8KTask


def _write_word_problems(data_dir: Path, rows: int = 20) -> Path:
    """A GSM8K-format data set of one-step word problems (GSM8K has no step checker)."""
    data_dir.mkdir(parents=True, exist_ok=True)
    for name, offset in (("train.jsonl", 0), ("test.jsonl", 50)):
        lines = []
        for i in range(rows):
            a, b = i + offset, 2 * i + 3
            lines.append(json.dumps({"question": f"Tom has {a} apples and buys {b} more. How many does he have?",
                                     "answer": f"He has {a}+{b}=<<{a}+{b}={a + b}>>{a + b} apples.\n#### {a + b}"}))
        (data_dir / name).write_text("\n".join(lines) + "\n")
    return data_dir


@pytest.fixture
def word_problems(tmp_path) -> Path:
    return _write_word_problems(tmp_path / "gsm8k")


class _Untouchable:
    """A task that fails if the gate reads it."""

    name = "untouchable"

    def problems(self, split):
        raise AssertionError("the gate read the task although no PRM is trained")


def test_checker_labels_pass_on_a_task_with_a_checker():
    task = ArithTask(sft_size=10, train_size=10, test_size=4)
    assert check_label_source(task, "checker") == {"prm_labels": "checker (exact step checker)"}
    assert check_label_source(task, "monte_carlo") == {"prm_labels": "monte_carlo"}


def test_checker_labels_are_refused_in_one_line_naming_the_key_and_the_fixes(word_problems):
    task = GSM8KTask(str(word_problems))
    with pytest.raises(GateError) as err:
        check_label_source(task, "checker")
    message = str(err.value)
    assert "prm_train.label_source=checker" in message and "task 'gsm8k' has none" in message
    assert "prm_train.label_source=monte_carlo" in message and "arm=orm" in message
    assert "\n" not in message
    assert check_label_source(task, "monte_carlo") == {"prm_labels": "monte_carlo"}  # needs no checker


def test_no_learned_prm_checks_nothing():
    assert check_label_source(_Untouchable(), "checker", needed=False) == {"prm_labels": "none (no learned PRM)"}


@pytest.mark.parametrize("stage", ["ppo", "prm", "pipeline"])
def test_every_stage_that_trains_a_prm_refuses_before_sft(smoke_cfg, word_problems, stage):
    cfg = smoke_cfg(f"stage={stage}", "task=gsm8k", f"task.data_dir={word_problems}")
    assert cfg.arm.name == "prm" and cfg.prm_train.label_source == "checker"  # the defaults
    with pytest.raises(GateError, match=r"prm_train.label_source=checker needs an exact step checker"):
        run(cfg)
    assert not Path(cfg.artifacts_dir).exists()  # no SFT checkpoint, no PRM: nothing was made
    assert not (Path(cfg.run_dir) / "init_model").exists()


def test_the_orm_arm_and_monte_carlo_labels_pass_the_early_gates(smoke_cfg, word_problems):
    from prmppo.config.build import build
    from prmppo.stages.inputs import early_gates

    for overrides, expected in ((["arm=orm"], "none (no learned PRM)"),
                                (["prm_train.label_source=monte_carlo"], "monte_carlo")):
        cfg = smoke_cfg("task=gsm8k", f"task.data_dir={word_problems}", *overrides)
        assert early_gates(cfg, build(cfg.task, "task"))["prm_labels"] == {"prm_labels": expected}
