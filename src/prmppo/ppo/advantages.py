"""Step 4 of the PPO iteration: per-token advantages from the reward terms and the KL to the reference.

The rule, the same for every arm and every estimator:

    A = normalise(task advantages) + KL pull

- **task advantages** come from the reward terms alone (outcome, steps): decoupled-lambda GAE
  with the critic (the critic learns the task return; rows cut at the length limit bootstrap from
  the value there), or a group baseline (`rloo`/`grpo`, `estimators.group_baseline_advantages`);
- **normalise** (`whiten_advantages`): GAE's are centred and scaled over the update's tokens, a
  group baseline's only scaled (each prompt is centred already; a shift would push every sample
  of an all-solved prompt the same way); the std divided by is at least `MIN_TASK_STD`;
- **KL pull**: the return-to-go of the in-reward KL, `-kl_coef * kl_t` per token, added *after*
  the normalisation, so its weight is `kl_coef` whatever the arm's reward scale. Dividing it by
  the arm's own advantage std (as a whitening of the sum would) makes the arms differ in how hard
  they are pulled to the reference, not only in their reward: on one real batch the ORM arm's
  advantage std scaled the KL by 2.09 and the PRM arm's by 1.30.

So a batch whose every group is uniform (all samples scored alike) has zero task advantage and
moves the policy by the configured KL pull alone, identically in both arms. The KL stays out of
the group baselines and out of grpo's group statistics: it is a per-token cost of the sampled
tokens, known exactly, which needs no baseline.

`effective_kl_coef` measures the weight the KL actually got from the advantages and their task part (what
`compute` gives at kl_coef 0), so the logged `kl/effective_coef` is a measurement, not the configured value.

Tests: `pytest tests/ppo/test_advantages.py -q`.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from prmppo.ppo import estimators, maths


# the normalisation divides by at least this std (advantage units): a batch whose task advantages are
# all noise-sized (every group uniform, identical samples' PRM scores differing by numerical jitter)
# is magnified at most 100x instead of to unit size. A real contrast is far above it: one non-uniform
# group of 0/1 outcomes among 64 groups of 4 already gives a token std of about 0.09.
MIN_TASK_STD = 1e-2


class Advantages(NamedTuple):
    advantages: Tensor  # [B, T] what the policy loss reads; 0 on padding
    returns: Tensor  # [B, T] the critic's targets (task return; zeros without a critic)
    task_scale: float  # the factor the normalisation applied to the task advantages (1.0 when off)
    kl_pull: Tensor  # [B, T] the KL's part of `advantages`
    task: Tensor  # [B, T] the task part: `advantages` at kl_coef 0, 0 off the update's tokens


def compute(terms: list[tuple[Tensor, Tensor]], kl: Tensor | None, mask: Tensor, update_mask: Tensor, *,
            estimator: str, group_size: int, gamma: float, kl_coef: float, whiten: bool,
            group_std_floor: float, group_same_tol: float, lam_actor: float = 1.0, lam_critic: float = 1.0,
            values: Tensor | None = None, bootstrap: Tensor | None = None) -> Advantages:
    """The advantages of one batch under the rule in the module docstring.

    `terms`: the reward terms as (values [B, T], events [B, T] bool); `kl` [B, T] the per-token KL
    estimate (None: no KL pull, the advantages are the task part); `mask` [B, T] the response tokens;
    `update_mask` [B, T] the tokens the update learns from (the normalisation's statistics are taken over these). `values` [B, T] and `bootstrap` [B]
    (the value after a truncated row's last token, 0 for rows that ended) are the critic's, used when
    `estimator` is `gae`. `group_std_floor` and `group_same_tol` (reward units, 0 = off) are grpo's
    (`ppo.group_std_floor`, `ppo.group_same_tol`); the caller passes them, so no second default exists.
    """
    zero = torch.zeros((), dtype=torch.float32, device=mask.device)
    if estimator == "gae":
        if values is None:
            raise ValueError("estimator 'gae' needs the critic's values")
        task_rewards = sum((v.to(values.dtype) for v, _ in terms), torch.zeros_like(values))  # [B, T]
        task, returns = estimators.decoupled_gae(task_rewards, values, mask, gamma, lam_actor, lam_critic, bootstrap)
    else:
        task = estimators.group_baseline_advantages(terms, mask, group_size, gamma, estimator, group_std_floor,
                                                      group_same_tol)
        returns = torch.zeros_like(task)
    scale = 1.0
    if whiten:
        # scale-only for a group baseline (centred per prompt already); GAE is centred and scaled
        std = maths.masked_var(task, update_mask).sqrt().clamp(min=MIN_TASK_STD)
        scale = float(1.0 / std)
        if estimator == "gae":
            task = task - maths.masked_mean(task, update_mask)
        task = task / std
    task = torch.where(update_mask.bool(), task, zero)
    # kl None: the task part alone (an update of one optimizer step adds the pull itself, ppo/update.py)
    pull = torch.zeros_like(task) if kl is None else kl_pull(kl, mask, update_mask, kl_coef, gamma)  # [B, T]
    return Advantages(task + pull, returns, scale, pull, task)


def kl_pull(kl: Tensor, mask: Tensor, update_mask: Tensor, kl_coef: float, gamma: float) -> Tensor:
    """The KL pull [B, T]: the return-to-go of `-kl_coef * kl` over each row's response tokens (`mask`),
    0 off the update's tokens (`update_mask`). Row by row, so any subset of rows gives the same bits."""
    zero = torch.zeros((), dtype=torch.float32, device=mask.device)
    pull = estimators.returns_to_go(torch.where(mask.bool(), -kl_coef * kl, zero), mask, gamma)  # [B, T]
    return torch.where(update_mask.bool(), pull, zero)


def effective_kl_coef(with_kl: Tensor, without_kl: Tensor, kl: Tensor, mask: Tensor, gamma: float) -> float:
    """The weight c the KL got in the advantages: the least-squares fit of
    with_kl - without_kl = -c * G over `mask`'s tokens, G [B, T] the return-to-go of the per-token KL
    `kl`. Under the rule of this module it is `kl_coef` in every arm; a rule that normalised the KL
    together with the task advantages gives about kl_coef / std(task advantages). nan when G is 0."""
    pull = estimators.returns_to_go(torch.where(mask.bool(), kl, torch.zeros_like(kl)), mask, gamma)  # [B, T]
    norm = maths.masked_sum(pull * pull, mask)
    if float(norm) == 0.0:
        return float("nan")
    return float(-maths.masked_sum((with_kl - without_kl) * pull, mask) / norm)


def identical_groups(response_ids: Tensor, mask: Tensor, group_size: int) -> Tensor:
    """[G] bool: True for a prompt whose samples are all the same response (token for token)."""
    ids = torch.where(mask.bool(), response_ids, torch.full_like(response_ids, -1))  # [B, T]
    grouped = ids.reshape(-1, group_size, ids.shape[-1])  # [G, n, T]
    return (grouped == grouped[:, :1]).all(-1).all(-1)


def identical_group_share(advantages: Tensor, response_ids: Tensor, mask: Tensor, group_size: int) -> dict:
    """The share of groups of identical samples (`adv/identical_group_fraction`) and the share of the
    batch's task-advantage mass, sum |A| over the update's tokens of `advantages` (pass the task part:
    the KL pull differs between identical samples by nothing), that they carry (`adv/identical_group_mass`).
    Identical samples differ in nothing a reward could judge, so their mass is noise: under grpo without
    a std floor it was 29% of the mass at a policy with 66% identical groups."""
    if group_size < 2:
        return {}
    same = identical_groups(response_ids, mask, group_size).repeat_interleave(group_size)  # [B]
    mass = maths.masked_sum(advantages.abs(), mask, dim=-1)  # [B]
    total = float(mass.sum())
    return {"adv/identical_group_fraction": float(same.float().mean()),
            "adv/identical_group_mass": float(mass[same].sum()) / total if total > 0 else 0.0}
