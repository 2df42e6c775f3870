"""The reward contract: what every reward object returns, whatever the arm.

`reward(batch) -> (RewardTerms, metrics)`. Each term names a reward source (`outcome`,
`process`) and carries the per-token reward it pays, `values [B, T]`, and the tokens where it can
pay, `events [B, T]` (the outcome: each row's last token; a PRM: every step end, also where the
step scored 0). GAE reads only `total` (the sum of the terms); a group baseline compares each
term with the same term of the prompt's other samples, so an outcome is never weighed against
a step score (`prmppo.ppo.estimators.group_baseline_advantages`). The PPO loop never asks which arm it
runs: the seam is this container.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from torch import Tensor


class RewardTerm(NamedTuple):
    values: Tensor  # [B, T] reward at event tokens, 0 elsewhere
    events: Tensor  # [B, T] bool, the tokens where this term pays


@dataclass(frozen=True)
class RewardTerms:
    terms: dict[str, RewardTerm]

    @property
    def total(self) -> Tensor:
        """[B, T] the sum of every term: the per-token reward GAE sees."""
        values = [term.values for term in self.terms.values()]
        return sum(values[1:], values[0])
