"""What watches a PPO run between iterations: the ratio tripwire, the canary, test accuracy during
PPO, and the coordinated-stop flag. `Monitors.after_iteration` is called once per iteration by the
outer loop (`ppo/run.py`) and returns the metrics to add, the new alarms and the test evaluation.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from collections.abc import Callable

from prmppo.guards.canary import Canary
from prmppo.guards.tripwires import RatioTripwire

log = logging.getLogger("prmppo")

ENGINE_GAP_MARGIN = 3.0  # the stale-sync alarm sits this many times above the measured noise floor


def engine_gap_tripwire(trainer, max_first_ratio_dev: float, max_engine_logprob_gap: float
                        ) -> tuple[RatioTripwire, dict]:
    """The ratio tripwire with its engine-gap limit set above this run's noise floor.

    The engine and the trainer compute the same logprobs with different kernels; in fp32 they
    agree to ~1e-6 nats per token, in bf16 to ~1e-2, i.e. at the configured limit. So the gap is
    measured once at launch while both hold the same weights, and the alarm fires only beyond
    max(ppo.max_engine_logprob_gap, ENGINE_GAP_MARGIN x that floor). Returns (tripwire, banner entry)."""
    floor = trainer.engine_gap_at_identical_weights()
    limit = max(max_engine_logprob_gap, ENGINE_GAP_MARGIN * floor)
    tripwire = RatioTripwire(max_first_ratio_dev, limit)
    return tripwire, {"measured_at_identical_weights": floor, "limit": limit, **tripwire.self_test()}


class StopFlag:
    """A coordinated stop request, read at iteration boundaries (an optimizer-step boundary).

    SIGTERM only sets the flag (the handler does no work, so a step is never torn); the wall
    clock sets it once `max_wall_seconds` (> 0) have passed since PPO training started in this
    launch. The previous SIGTERM handler is restored on exit.
    """

    def __init__(self, max_wall_seconds: float, start: float):
        self.max_wall_seconds, self.start = max_wall_seconds, start
        self.reason: str | None = None
        self._previous = None

    def _on_sigterm(self, signum, frame) -> None:
        self.reason = self.reason or "sigterm"

    def __enter__(self) -> "StopFlag":
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGTERM, self._on_sigterm)
        return self

    def __exit__(self, *exc) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)

    def check(self) -> str | None:
        if self.reason is None and 0 < self.max_wall_seconds <= time.time() - self.start:
            self.reason = "max_wall_seconds"
        return self.reason


class Monitors:
    """The tripwire and canary alarms of each iteration, and test accuracy every `eval_every` iterations.

    `test_eval(iterations_done) -> eval/ metrics` (0 turns it off through `eval_every`)."""

    def __init__(self, tripwire: RatioTripwire, canary: Canary, test_eval: Callable[[int], dict], eval_every: int,
                 iterations: int):
        self.tripwire, self.canary, self.test_eval = tripwire, canary, test_eval
        self.eval_every, self.iterations = eval_every, iterations

    def before_first(self) -> dict:
        """The starting policy's test accuracy (the curves' first point), or {} when it is off."""
        return self.test_eval(0) if self.eval_every > 0 else {}

    def after_iteration(self, iteration: int, metrics: dict) -> tuple[dict, list[dict], dict]:
        """(canary metrics to add to the row, this iteration's alarms, the test evaluation if due)."""
        alarms = [{"iteration": iteration, "tripwire": "ratio", "message": m} for m in self.tripwire.check(metrics)]
        alarms += [{"iteration": iteration, "tripwire": "canary", "message": m} for m in self.canary.check(iteration)]
        for alarm in alarms:
            log.warning("alarm at ppo it %d: %s", iteration, alarm["message"])
        added = {}
        if self.canary.due(iteration):
            added = {"canary/greedy_accuracy": self.canary.last, "canary/best": self.canary.best,
                     "canary/alarm": float(any(a["tripwire"] == "canary" for a in alarms))}
        due = self.eval_every > 0 and ((iteration + 1) % self.eval_every == 0 or iteration == self.iterations - 1)
        return added, alarms, (self.test_eval(iteration + 1) if due else {})
