"""scripts/credit_by_quarter.py: per-quarter credit, explained variance and accuracy from metrics.jsonl."""

from __future__ import annotations

import importlib.util
import json

from conftest import REPO

spec = importlib.util.spec_from_file_location("credit_by_quarter", REPO / "scripts" / "credit_by_quarter.py")
credit = importlib.util.module_from_spec(spec)
spec.loader.exec_module(credit)


def test_summary_by_hand(tmp_path):
    rows = [{"stage": "ppo_eval", "step": 0, "eval/test_greedy_accuracy": 0.5}]  # not a PPO row: ignored
    for it in range(3):
        rows.append({"stage": "ppo", "step": it, "rollout/accuracy": 0.1 * (it + 1),
                     "adv/right_q1": 1.0 - it, "adv/right_q2": 0.5, "adv/right_q3": 0.25, "adv/right_q4": -0.5 * it,
                     "value/explained_variance": None if it == 0 else 0.2 * it})
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    s = credit.summarise(tmp_path)
    assert s["iterations"] == 3
    assert s["right_min"] == [-1.0, 0.5, 0.25, -1.0]
    assert s["right_mean"] == [0.0, 0.5, 0.25, -0.5]
    assert abs(s["explained_variance_last50"] - 0.3) < 1e-12  # (0.2 + 0.4) / 2; the None row is skipped
    assert abs(s["accuracy_first10"] - 0.2) < 1e-12 and abs(s["accuracy_last20"] - 0.2) < 1e-12
