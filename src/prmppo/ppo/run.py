"""The PPO stage's outer loop: resume, iterate, monitor, log, checkpoint, stop.

    for it in range(keeper.resume(...), iterations):
        metrics = trainer.iteration(it)                       # 1-6 of the algorithm (ppo/loop.py)
        added, alarms, evaluated = monitors.after_iteration(it, metrics)
        logger.log(it, metrics)
        keeper.maybe_save(it, ..., force=last or stopping)

A coordinated stop (SIGTERM or `max_wall_seconds`, `guards/monitors.py` StopFlag) ends the loop
after the iteration in flight, with a checkpoint saved at that optimizer-step boundary.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Callable

from prmppo.guards.monitors import Monitors, StopFlag
from prmppo.logger.console import print_summary, progress
from prmppo.ppo.checkpoint import CheckpointKeeper

log = logging.getLogger("prmppo")


@dataclass
class PPORun:
    trainer: object  # PPOTrainer
    keeper: CheckpointKeeper
    monitors: Monitors
    logger: object  # MetricsLogger
    iterations: int
    label: str  # e.g. "ppo[prm]", for the console
    console: bool
    # called once, after this launch's first iteration (every graph of a compiled run exists by then)
    after_first_iteration: Callable[[], None] = lambda: None

    def run(self, first: int, stop: StopFlag, start: float) -> tuple[list[dict], str | None]:
        """Iterations `first`..`iterations - 1`; returns (this launch's metrics rows, the stop reason or None)."""
        history: list[dict] = []
        if first == 0:
            evaluated = self.monitors.before_first()
            if evaluated:
                self.logger.log(0, evaluated, stage="ppo_eval")
        for iteration in progress(range(first, self.iterations), desc=self.label, unit="it", initial=first,
                                  total=self.iterations, enabled=self.console):
            metrics = self.trainer.iteration(iteration)
            metrics["perf/wall_s"] = time.time() - start
            if iteration == first:
                self.after_first_iteration()
            added, alarms, evaluated = self.monitors.after_iteration(iteration, metrics)
            metrics.update(added)
            self.logger.log(iteration, metrics)
            history.append(metrics)
            if evaluated:
                self.logger.log(iteration, evaluated, stage="ppo_eval")
            for warning in self.keeper.record(alarms):  # before the save, so its meta holds the pin
                log.warning(warning)
            print_summary(self.label, iteration, self.iterations, {**metrics, **evaluated}, self.console)
            last = iteration == self.iterations - 1
            # every rank must agree to stop after the same iteration (a SIGTERM may reach them apart, and each
            # rank has its own wall clock); on one process this is stop.check()
            stopping = self.trainer.ranks.any(bool(stop.check()))
            self.keeper.maybe_save(iteration, self.trainer.policy, self.trainer, force=stopping or last)
            if stopping and not last:
                return history, stop.reason or "a stop on another rank"
        return history, None
