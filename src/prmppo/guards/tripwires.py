"""Tripwires: checks run while training that raise an alarm, or abort the run, on a silent failure.

`RatioTripwire` reads two metrics of each PPO iteration. On the first minibatch the policy has
not been updated yet, so its ratio to the old logprobs must be ~1 (`ppo/first_minibatch_ratio_dev`
= max |ratio - 1|); and the engine sampled with the weights the trainer holds, so their logprobs
must match (`rollout/engine_logprob_abs_diff`, mean |engine - trainer| per response token, nats).
Either beyond its limit means stale engine weights or a trainer/engine mismatch: an alarm, not an
abort, because training still runs; the alarms land in `stage_result.json`. The tripwire checks
itself at launch (`self_test`) by feeding perturbed metrics: a wire that cannot fire is a defect.

`SkipBudget` counts optimizer steps skipped for a non-finite gradient and aborts the run with
`TrainingAborted` when too many are skipped in a row or in total.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from prmppo.errors import PrmppoError

RATIO_DEV = "ppo/first_minibatch_ratio_dev"
ENGINE_GAP = "rollout/engine_logprob_abs_diff"


class TrainingAborted(PrmppoError):
    """Training stopped because a limit on broken steps was exceeded; the message names the key and counts."""


class TripwireError(PrmppoError):
    """A tripwire failed its own launch self-test."""


@dataclass(frozen=True)
class RatioTripwire:
    """Alarms when the first-minibatch ratio or the engine-vs-trainer logprob gap exceeds its limit."""

    max_ratio_dev: float  # max |ratio - 1| on an iteration's first minibatch (dimensionless)
    max_logprob_gap: float  # max mean |engine - trainer| logprob per response token, in nats

    def check(self, metrics: dict) -> list[str]:
        """One alarm sentence per metric beyond its limit (a NaN counts as beyond); metrics absent are skipped."""
        alarms = []
        for key, limit, name, meaning in (
                (RATIO_DEV, self.max_ratio_dev, "ppo.max_first_ratio_dev",
                 "the policy differed from the one that scored the batch before any update"),
                (ENGINE_GAP, self.max_logprob_gap, "ppo.max_engine_logprob_gap",
                 "the engine sampled with weights other than the trainer's (stale sync?)")):
            if key in metrics and not float(metrics[key]) <= limit:
                alarms.append(f"{key}={float(metrics[key]):.3g} > {name}={limit}: {meaning}")
        return alarms

    def self_test(self) -> dict:
        """Feed metrics just inside and just beyond each limit; raise unless exactly the beyond ones fire."""
        quiet = self.check({RATIO_DEV: self.max_ratio_dev, ENGINE_GAP: self.max_logprob_gap})
        loud = self.check({RATIO_DEV: self.max_ratio_dev * 2 + 1e-6, ENGINE_GAP: self.max_logprob_gap * 2 + 1e-6})
        nan = self.check({RATIO_DEV: math.nan, ENGINE_GAP: math.nan})
        if quiet or len(loud) != 2 or len(nan) != 2:
            raise TripwireError(f"ratio tripwire self-test failed: at the limits it gave {quiet}, beyond them "
                                f"{loud}, on NaN {nan}; expected none, two and two alarms")
        return {"max_ratio_dev": self.max_ratio_dev, "max_logprob_gap": self.max_logprob_gap, "self_test": "fired"}


@dataclass
class SkipBudget:
    """Limits on optimizer steps skipped for a non-finite gradient.

    `max_fraction` is of the run's planned optimizer steps (`total_steps`), so one early skip
    does not read as 100% skipped.
    """

    max_consecutive: int
    max_fraction: float
    total_steps: int
    skipped: int = field(default=0, init=False)
    consecutive: int = field(default=0, init=False)
    steps: int = field(default=0, init=False)

    def record(self, skipped: bool) -> None:
        """Count one optimizer step; raise `TrainingAborted` when a limit is exceeded."""
        self.steps += 1
        self.consecutive = self.consecutive + 1 if skipped else 0
        self.skipped += int(skipped)
        if self.consecutive > self.max_consecutive:
            raise TrainingAborted(
                f"{self.consecutive} consecutive optimizer steps had a non-finite gradient, more than "
                f"ppo.max_consecutive_skipped_steps={self.max_consecutive} ({self.skipped} skipped of {self.steps} "
                "steps so far): the loss or the weights have diverged; lower ppo.lr or check the reward")
        budget = math.floor(self.max_fraction * self.total_steps)
        if self.skipped > budget:
            raise TrainingAborted(
                f"{self.skipped} of {self.steps} optimizer steps so far had a non-finite gradient, more than "
                f"ppo.max_skipped_fraction={self.max_fraction} of the run's {self.total_steps} planned steps "
                f"(= {budget}): the loss or the weights have diverged; lower ppo.lr or check the reward")
