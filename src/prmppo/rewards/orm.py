"""`reward=orm`: the outcome reward on the last response token (the control arm).

The reward contract shared by every arm: `reward(batch) -> (rewards [B, T], metrics)`, per-token
rewards aligned with the response tokens of `batch` (zero on padding). The PPO loop adds the
KL term and runs GAE on this tensor whatever filled it, so it never branches on the arm.
"""

from __future__ import annotations

import torch
from torch import Tensor


def last_token_index(response_mask: Tensor) -> Tensor:
    """Index of each row's last real response token. response_mask: [B, T] -> [B]."""
    lengths = response_mask.sum(-1).long()  # [B]
    if bool((lengths == 0).any()):
        raise ValueError("a response has no tokens; the engine must return at least one token per row")
    return lengths - 1


def outcome_rewards(outcome: Tensor, response_mask: Tensor, correct_reward: float, wrong_reward: float) -> Tensor:
    """[B, T] zeros except the last real token: `correct_reward` if outcome[b] else `wrong_reward`."""
    rewards = torch.zeros_like(response_mask, dtype=torch.float32)  # [B, T]
    values = torch.where(outcome.bool(), correct_reward, wrong_reward).to(torch.float32)  # [B]
    rewards.scatter_(1, last_token_index(response_mask)[:, None], values[:, None])
    return rewards


class OutcomeReward:
    """The verifier's outcome reward, weighted by `w_outcome`, on the last response token."""

    def __init__(self, correct_reward: float = 1.0, wrong_reward: float = 0.0, w_outcome: float = 1.0,
                 eta: float = 1.0):
        # `eta` (the PRM clip threshold) is accepted and ignored: every reward config carries it so
        # one sweep can cross both arms with `reward.eta=...`
        self.correct_reward = correct_reward
        self.wrong_reward = wrong_reward
        self.w_outcome = w_outcome

    # capabilities the runner reads (it never asks which arm it runs)
    needs_step_scorer = False
    needs_learned_prm = False

    def __call__(self, batch) -> tuple[Tensor, dict[str, float]]:
        rewards = self.w_outcome * outcome_rewards(batch.outcome, batch.response_mask, self.correct_reward,
                                                   self.wrong_reward)  # [B, T]
        return rewards, {"reward/outcome_mean": float(rewards.sum(-1).mean())}
