"""The critic: a linear value per token on the policy's last hidden state, with PopArt-style return statistics.

`LoraPolicy` and `FullPolicy` (models/policy.py) carry one when the advantage estimator uses a
critic (`ppo.advantage_estimator=gae`); the PPO loop learns normalised returns through it.

Tests: `pytest tests/ppo/test_loop.py -q -k value_head`.
"""

from __future__ import annotations

import torch
from torch import nn


class ValueHead(nn.Module):
    """A linear value estimate per token from the policy's last hidden state, in return units.

    The linear layer predicts a *normalised* return z; the value is mean + std * z with running
    return statistics (`update_return_stats`). Returns on these tasks sit anywhere in about
    [0, 5] (step scores plus the outcome) while Adam moves a weight by about the learning rate
    per step, so an unnormalised head spends most of a run walking its bias to the mean return.
    Statistics change the way PopArt does (van Hasselt et al. 2016, "Learning values across many
    orders of magnitude"): the layer is rescaled so every prediction stays what it was.
    """

    def __init__(self, hidden_size: int, detach_hidden: bool, stats_decay: float = 0.9):
        super().__init__()
        self.detach_hidden = detach_hidden
        self.stats_decay = stats_decay
        self.linear = nn.Linear(hidden_size, 1)
        nn.init.zeros_(self.linear.weight)  # values start at the mean return: no bias in the first advantages
        nn.init.zeros_(self.linear.bias)
        self.register_buffer("return_mean", torch.zeros(()))
        self.register_buffer("return_second_moment", torch.ones(()))
        self.register_buffer("stats_updates", torch.zeros((), dtype=torch.long))

    @property
    def return_std(self) -> torch.Tensor:
        variance = self.return_second_moment - self.return_mean.square()
        return variance.clamp(min=1e-4).sqrt()  # floor 1e-2: constant returns must not divide by ~0

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:  # [B, L, H] -> [B, L]
        if self.detach_hidden:
            hidden = hidden.detach()  # the critic must not move the policy's features
        with torch.autocast(hidden.device.type, enabled=False):  # the critic stays fp32 under ppo.autocast
            z = self.linear(hidden.float()).squeeze(-1)
        return self.return_mean + self.return_std * z

    def normalise(self, values: torch.Tensor) -> torch.Tensor:
        """Values or returns in the head's normalised units (where the value loss is taken)."""
        return (values - self.return_mean) / self.return_std

    @torch.no_grad()
    def update_return_stats(self, returns: torch.Tensor, mask: torch.Tensor,
                            values: torch.Tensor | None = None) -> torch.Tensor | None:
        """Fold a batch's returns (masked tokens) into the running statistics; predictions are unchanged,
        except at the first batch, which moves a head still at zero from predicting 0 to the mean return.
        `values` [B, T] (the head's predictions before this call, the update's old values) come back as
        the head predicts them now, so the value clip of the first update is taken around what the head
        predicts, not around the initial statistics' 0 (which clipped most of the first value loss)."""
        keep = mask.bool()
        if not keep.any():
            return values
        before = None if values is None else self.normalise(values)
        batch = returns[keep].float()
        first = int(self.stats_updates) == 0
        decay = 0.0 if first else self.stats_decay  # the first batch sets the statistics outright
        old_mean, old_std = self.return_mean.clone(), self.return_std.clone()
        self.return_mean.mul_(decay).add_((1 - decay) * batch.mean())
        self.return_second_moment.mul_(decay).add_((1 - decay) * batch.square().mean())
        self.stats_updates.add_(1)
        if first:  # nothing learned yet: the head's output z is kept, so it now reads as the batch's statistics
            return None if values is None else torch.where(keep, self.return_mean + self.return_std * before, values)
        new_std = self.return_std
        self.linear.weight.mul_(old_std / new_std)
        self.linear.bias.copy_((old_std * self.linear.bias + old_mean - self.return_mean) / new_std)
        return values
