"""Test accuracy during PPO (`ppo_eval` rows) and canary metrics in metrics.jsonl, on a real smoke run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import RIGHT_SOMETIMES
from prmppo.app import run
from prmppo.evaluation import score
from prmppo.models.loading import load_model, load_tokenizer

# PPO runs from the right-sometimes SFT policy (150 SFT steps per seed, built once a session)
pytestmark = pytest.mark.slow


def _rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_test_accuracy_is_logged_before_every_k_iterations_and_after_the_last(smoke_cfg, right_sometimes_sft):
    # from an SFT policy that is right part of the time, on 16 problems: the recount below compares
    # accuracies strictly between 0 and 1, which a policy that is never right could not give
    cfg = smoke_cfg("stage=ppo", *RIGHT_SOMETIMES, "eval.during_ppo_problems=16", "eval.during_ppo_k=4",
                    "ppo.iterations=3", "eval.every=2", "canary.every=1", "canary.n_problems=16")
    (made,) = right_sometimes_sft(Path(cfg.artifacts_dir), cfg.seed).values()
    summary = run(cfg)
    rows = _rows(Path(cfg.run_dir))
    evals = [r for r in rows if r["stage"] == "ppo_eval"]
    # before training, after iteration 2 (every 2) and after the last (3)
    assert [r["eval/ppo_iterations"] for r in evals] == [0, 2, 3]
    assert all(r["eval/n_problems"] == cfg.eval.during_ppo_problems for r in evals)
    # the first evaluation is the SFT policy's: recompute it independently from the SFT checkpoint
    sft = Path(json.loads((Path(cfg.run_dir) / "banner.json").read_text())["base_checkpoint"])
    assert sft == made  # PPO started from the fixture's policy (reused, not retrained)
    from prmppo.config.build import build

    task = build(cfg.task, "task")
    expected = score(load_model(sft), load_tokenizer(sft), task, task.problems("test")[: cfg.eval.during_ppo_problems],
                     k=cfg.eval.during_ppo_k, temperature=cfg.eval.temperature,
                     max_new_tokens=cfg.eval.max_new_tokens, batch_rows=cfg.eval.batch_rows, seed=cfg.seed)
    assert 0 < expected["greedy_accuracy"] < 1 and 0 < expected["sampled_accuracy"] < 1
    assert evals[0]["eval/test_greedy_accuracy"] == expected["greedy_accuracy"]
    assert evals[0]["eval/test_sampled_accuracy"] == expected["sampled_accuracy"]
    assert evals[0]["eval/test_pass@4"] == expected["pass@4"] and all("eval/test_pass@4" in r for r in evals)
    # each evaluation's per-problem outcomes, in the same order as the test problems, agree with its row
    for row in evals:
        saved = json.loads((Path(cfg.run_dir) / "ppo_eval" / f"iteration_{row['eval/ppo_iterations']:05d}.json")
                           .read_text())
        outcomes = saved["problems"]
        assert saved["ppo_iterations"] == row["eval/ppo_iterations"] and saved["k"] == 4
        assert [o["index"] for o in outcomes] == list(range(cfg.eval.during_ppo_problems))
        assert sum(o["greedy_correct"] for o in outcomes) / len(outcomes) == row["eval/test_greedy_accuracy"]
        assert sum(o["correct_of_k"] for o in outcomes) / (4 * len(outcomes)) == row["eval/test_sampled_accuracy"]
    assert sorted(p.name for p in (Path(cfg.run_dir) / "ppo_eval").iterdir()) == [
        "iteration_00000.json", "iteration_00002.json", "iteration_00003.json"]
    # iteration rows are unchanged in number and carry the canary's checks
    ppo = [r for r in rows if r["stage"] == "ppo"]
    assert [r["step"] for r in ppo] == [0, 1, 2] and summary["policy_steps"] == 6
    canary = [json.loads(line) for line in (Path(cfg.run_dir) / "canary.jsonl").read_text().splitlines()]
    assert [r["canary/greedy_accuracy"] for r in ppo] == [c["greedy_accuracy"] for c in canary]
    assert all(0 < c["greedy_accuracy"] < 1 for c in canary)


def test_eval_every_zero_logs_no_test_rows(smoke_cfg):
    cfg = smoke_cfg("stage=ppo", "eval.every=0")
    run(cfg)
    assert not [r for r in _rows(Path(cfg.run_dir)) if r["stage"] == "ppo_eval"]
