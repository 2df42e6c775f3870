"""KL between the policy and the reference policy, estimated per token from sampled tokens.

The responses are sampled from the policy, and per token we know the log ratio
r = logprobs - ref_logprobs = log pi(x) / pi_ref(x). Following Schulman, "Approximating KL
Divergence" (2020), three estimators of KL(pi || pi_ref) = E_pi[r]:

- `k1` = r: unbiased, high variance, negative on some tokens;
- `k2` = 0.5 * r^2: biased (low bias when pi ~ pi_ref), always >= 0, low variance;
- `k3` = exp(-r) - 1 + r = (pi_ref/pi - 1) - log(pi_ref/pi): unbiased and always >= 0
  (since e^x >= 1 + x). Not clamped here: a token whose r is very negative gives exp(-r) large.

Two placements, chosen by config, never by branching on the arm:
- in the reward: `kl_penalty_rewards` returns -kl_coef * k * mask, added to the task reward
  tensor before GAE;
- in the loss: the loop takes `kl_estimate` and reduces it with `prmppo.ppo.maths.aggregate`
  (same mode and counts as the policy loss), then adds kl_coef times that to the loss.
"""

from __future__ import annotations

import torch
from torch import Tensor

KL_ESTIMATORS = ("k1", "k2", "k3")


def kl_estimate(logprobs: Tensor, ref_logprobs: Tensor, estimator: str) -> Tensor:
    """Per-token KL(pi || pi_ref) estimate [B, T] from r = logprobs - ref_logprobs.

    No masking here: padded positions hold whatever the inputs imply; callers mask.
    """
    if estimator not in KL_ESTIMATORS:
        raise ValueError(f"KL estimator {estimator!r} is unknown; valid estimators are "
                         f"{', '.join(KL_ESTIMATORS)}")
    if logprobs.shape != ref_logprobs.shape:
        raise ValueError(f"logprobs shape {tuple(logprobs.shape)} and ref_logprobs shape "
                         f"{tuple(ref_logprobs.shape)} must be equal")
    log_ratio = logprobs - ref_logprobs  # [B, T]
    if estimator == "k1":
        return log_ratio
    if estimator == "k2":
        return 0.5 * log_ratio.square()
    return torch.expm1(-log_ratio) + log_ratio


def kl_penalty_rewards(logprobs: Tensor, ref_logprobs: Tensor, mask: Tensor, kl_coef: float,
                       estimator: str) -> Tensor:
    """In-reward KL placement: -kl_coef * kl_estimate on real tokens, 0 on padding, [B, T]."""
    if kl_coef < 0:
        raise ValueError(f"kl_coef={kl_coef!r} is invalid; it must be >= 0")
    if mask.shape != logprobs.shape:
        raise ValueError(f"mask shape {tuple(mask.shape)} must equal logprobs shape "
                         f"{tuple(logprobs.shape)}")
    per_token = kl_estimate(logprobs, ref_logprobs, estimator)  # [B, T]
    penalty = -kl_coef * per_token
    return torch.where(mask.bool(), penalty, torch.zeros_like(penalty))
