"""Canary: greedy accuracy on a fixed held-out set every `every` iterations, and an alarm on a drop.

A reward that the policy learns to hack raises the training reward while real accuracy falls;
the canary measures the real thing on the same problems each time, appends one JSON line per
check to `<run_dir>/canary.jsonl`, and raises an alarm when accuracy falls more than `max_drop`
below the best seen so far. On an alarm, the checkpoint keeper (`ppo/checkpoint.py`) pins the
checkpoint of the best check against pruning (when the best check fell on a checkpoint boundary).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class Canary:
    """`evaluate(problems) -> greedy accuracy in [0, 1]` of the current policy; `every=0` turns it off."""

    problems: list
    every: int  # iterations between checks
    max_drop: float  # accuracy points (fraction in [0, 1]) below the best that raise an alarm
    path: Path
    evaluate: Callable[[list], float]
    best: float = field(default=float("-inf"), init=False)
    best_iteration: int = field(default=-1, init=False)
    last: float | None = field(default=None, init=False)  # the accuracy of the latest check

    def due(self, iteration: int) -> bool:
        return self.every > 0 and (iteration + 1) % self.every == 0

    def check(self, iteration: int) -> list[str]:
        """Evaluate when due; append the result to `path`; return an alarm sentence on a drop beyond `max_drop`."""
        if not self.due(iteration):
            return []
        accuracy = float(self.evaluate(self.problems))
        self.last = accuracy
        alarms = []
        if self.best - accuracy > self.max_drop:
            alarms.append(f"canary greedy accuracy {accuracy:.3f} on {len(self.problems)} held-out problems fell "
                          f"{self.best - accuracy:.3f} below the best {self.best:.3f} (iteration "
                          f"{self.best_iteration}), more than canary.max_drop={self.max_drop}")
        if accuracy > self.best:
            self.best, self.best_iteration = accuracy, iteration
        with self.path.open("a") as handle:
            handle.write(json.dumps({"iteration": iteration, "greedy_accuracy": accuracy, "best": self.best,
                                     "best_iteration": self.best_iteration, "alarm": bool(alarms)}) + "\n")
        return alarms
