"""`reward=orm`: the outcome reward on the last response token (the control arm).

The reward contract shared by every arm (`rewards/terms.py`): `reward(batch) -> (RewardTerms,
metrics)`, per-token rewards aligned with the response tokens of `batch` (zero on padding), one
term per source. Here there is one term, `outcome`.
Every reward is built with the run's `seed` and has `state_dict()` / `load_state_dict()`: the
random state a resume needs (empty here), which PPO checkpoints save (`ppo/checkpoint.py`).
"""

from __future__ import annotations

import torch
from torch import Tensor

from prmppo.config.schema import OutcomeRewardConfig
from prmppo.rewards.terms import RewardTerm, RewardTerms


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

    def __init__(
        self,
        correct_reward: float = OutcomeRewardConfig.correct_reward,
        wrong_reward: float = OutcomeRewardConfig.wrong_reward,
        w_outcome: float = OutcomeRewardConfig.w_outcome,
        eta: float = OutcomeRewardConfig.eta,
        seed: int = 0,
    ):
        # `eta` (the PRM clip threshold) is accepted and ignored: every reward config carries it so
        # one sweep can cross both arms with `reward.eta=...`. `seed` (the run's, which the runner
        # passes to every reward) is ignored too: the outcome reward draws no random numbers
        self.correct_reward = correct_reward
        self.wrong_reward = wrong_reward
        self.w_outcome = w_outcome

    # capabilities the runner reads (it never asks which arm it runs)
    needs_step_scorer = False
    needs_learned_prm = False
    # reward keys this reward never reads (`config.validate.inert_keys`)
    inert_keys = ("eta",)

    def state_dict(self) -> dict[str, Tensor]:
        """Nothing to checkpoint (the PRM reward's holds its noise generator; `ppo/checkpoint.py`)."""
        return {}

    def load_state_dict(self, state: dict[str, Tensor]) -> None:
        if state:
            raise ValueError(f"the reward state holds {sorted(state)} but the outcome reward has none")

    def __call__(self, batch) -> tuple[RewardTerms, dict[str, float]]:
        term = outcome_term(batch, self.correct_reward, self.wrong_reward, self.w_outcome)
        return RewardTerms({"outcome": term}), {"reward/outcome_mean": float(term.values.sum(-1).mean())}


def outcome_term(batch, correct_reward: float, wrong_reward: float, weight: float) -> RewardTerm:
    """The weighted outcome reward as a term: it pays at each row's last real token."""
    values = weight * outcome_rewards(batch.outcome, batch.response_mask, correct_reward, wrong_reward)  # [B, T]
    events = torch.zeros_like(values, dtype=torch.bool)  # [B, T]
    events[torch.arange(values.shape[0]), last_token_index(batch.response_mask)] = True
    return RewardTerm(values, events)
