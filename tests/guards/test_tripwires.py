"""Tripwires fire beyond their limits, stay quiet within them, and abort on too many skipped steps."""

from __future__ import annotations

import math

import pytest

from prmppo.guards.tripwires import ENGINE_GAP, RATIO_DEV, RatioTripwire, SkipBudget, TrainingAborted, TripwireError


def test_ratio_tripwire_is_quiet_on_an_on_policy_iteration():
    wire = RatioTripwire(max_ratio_dev=1e-3, max_logprob_gap=1e-2)
    assert wire.check({RATIO_DEV: 2e-7, ENGINE_GAP: 3e-6, "ppo/kl_ref": 5.0}) == []
    assert wire.check({ENGINE_GAP: 3e-6}) == []  # value warmup: no policy ratio measured


def test_ratio_tripwire_names_each_metric_beyond_its_limit():
    wire = RatioTripwire(max_ratio_dev=1e-3, max_logprob_gap=1e-2)
    (alarm,) = wire.check({RATIO_DEV: 2e-7, ENGINE_GAP: 0.05})
    assert alarm.startswith("rollout/engine_logprob_abs_diff=0.05 > ppo.max_engine_logprob_gap=0.01")
    (alarm,) = wire.check({RATIO_DEV: 0.3, ENGINE_GAP: 0.0})
    assert "ppo/first_minibatch_ratio_dev=0.3 > ppo.max_first_ratio_dev=0.001" in alarm
    assert len(wire.check({RATIO_DEV: math.nan, ENGINE_GAP: math.inf})) == 2  # NaN must not slip through


def test_ratio_tripwire_self_test_passes_a_working_wire_and_refuses_a_dead_one():
    assert RatioTripwire(1e-3, 1e-2).self_test()["self_test"] == "fired"

    class DeadWire(RatioTripwire):
        def check(self, metrics):
            return []

    with pytest.raises(TripwireError, match="self-test failed"):
        DeadWire(1e-3, 1e-2).self_test()


def test_skip_budget_aborts_after_too_many_consecutive_skips():
    budget = SkipBudget(max_consecutive=2, max_fraction=1.0, total_steps=100)
    for skipped in (True, True, False, True, True):  # a finite step resets the run of skips
        budget.record(skipped)
    with pytest.raises(TrainingAborted, match=r"3 consecutive .* ppo.max_consecutive_skipped_steps=2 \(5 skipped"):
        budget.record(True)


def test_skip_budget_aborts_past_the_fraction_of_planned_steps():
    budget = SkipBudget(max_consecutive=100, max_fraction=0.1, total_steps=20)  # budget: floor(0.1 * 20) = 2
    for skipped in (True, False, True, False):
        budget.record(skipped)
    with pytest.raises(TrainingAborted, match=r"3 of 5 optimizer steps .* ppo.max_skipped_fraction=0.1 .* 20 planned"):
        budget.record(True)
