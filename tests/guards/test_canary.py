"""The canary logs every check and alarms only on a drop beyond `max_drop` from the best so far."""

from __future__ import annotations

import json

from prmppo.guards.canary import Canary


def _canary(tmp_path, accuracies, every=1, max_drop=0.1):
    scores = iter(accuracies)
    seen = []

    def evaluate(problems):
        seen.append(list(problems))
        return next(scores)

    return Canary(["p1", "p2"], every, max_drop, tmp_path / "canary.jsonl", evaluate), seen


def test_canary_alarms_on_a_drop_beyond_max_drop_from_the_best(tmp_path):
    canary, seen = _canary(tmp_path, [0.5, 0.7, 0.65, 0.55])
    assert [canary.check(i) for i in range(3)] == [[], [], []]  # 0.7 - 0.65 = 0.05 <= 0.1
    (alarm,) = canary.check(3)  # 0.7 - 0.55 = 0.15 > 0.1
    assert "0.550" in alarm and "best 0.700 (iteration 1)" in alarm and "canary.max_drop=0.1" in alarm
    rows = [json.loads(line) for line in (tmp_path / "canary.jsonl").read_text().splitlines()]
    assert [r["greedy_accuracy"] for r in rows] == [0.5, 0.7, 0.65, 0.55]
    assert [r["alarm"] for r in rows] == [False, False, False, True] and rows[-1]["best"] == 0.7
    assert all(problems == ["p1", "p2"] for problems in seen)  # the same held-out set every time


def test_canary_runs_every_n_iterations_and_is_off_at_zero(tmp_path):
    canary, seen = _canary(tmp_path, [0.5, 0.5], every=3)
    for i in range(6):
        canary.check(i)
    assert len(seen) == 2  # after iterations 2 and 5
    off, seen_off = _canary(tmp_path / "x", [], every=0)
    assert [off.check(i) for i in range(5)] == [[]] * 5 and seen_off == []
