"""Step-score transforms: how PRM step scores s_k in [0, 1] become per-step rewards.

Pure functions over the compact step layout: `scores` [B, K] (row b's k-th step score) with a
bool `step_mask` [B, K] marking real steps; padded steps always come out 0. `apply_transform`
dispatches by name (`reward.transform`):

- `plain`     r_k = s_k
- `centered`  r_k = s_k - 0.5                        (an uninformative step earns nothing)
- `log`       r_k = log(max(s_k, 1e-6))              (log-probability that the step is right)
- `clip`      r_k = min(s_k - eta, 0)                (only penalties; "Clip" of Gao et al. 2024,
              "On Designing Effective RL Reward at Training Time for LLM Reasoning")
- `delta`     r_k = s_k - s_{k-1} with s_0 := 0      (potential-based shaping, Ng et al. 1999).
              The initial potential is 0, so the per-row sum telescopes to s_K: the process
              term's return equals the last step's score, and inserting extra steps cannot
              raise it (the loophole `plain` has: more steps, more reward).
- `min_form`  r_k = w_k * s_k, w = softmax(-s / T) over the row's real steps (T = 0.1 by
              default): the sum is a soft minimum of the step scores, so a trajectory is worth its
              weakest step. Cheng et al. 2025, "Stop Summation: Min-Form Credit Assignment Is All
              Process Reward Model Needs for Reasoning".

Tests: `pytest tests/rewards/test_transforms.py -q`.
"""

from __future__ import annotations

import torch
from torch import Tensor

LOG_EPSILON = 1e-6  # floor of s in `log`, so a score of exactly 0 gives log(1e-6) ~ -13.8, not -inf
TRANSFORM_NAMES = ("plain", "centered", "log", "clip", "delta", "min_form")


def _masked(values: Tensor, step_mask: Tensor) -> Tensor:
    return torch.where(step_mask, values, torch.zeros_like(values))


def plain(scores: Tensor, step_mask: Tensor) -> Tensor:
    return _masked(scores, step_mask)


def centered(scores: Tensor, step_mask: Tensor) -> Tensor:
    return _masked(scores - 0.5, step_mask)


def log(scores: Tensor, step_mask: Tensor) -> Tensor:
    return _masked(torch.log(scores.clamp(min=LOG_EPSILON)), step_mask)


def clip(scores: Tensor, step_mask: Tensor, eta: float) -> Tensor:
    return _masked((scores - eta).clamp(max=0.0), step_mask)


def delta(scores: Tensor, step_mask: Tensor) -> Tensor:
    """s_k - s_{k-1}, s_0 := 0. Real steps are a prefix of each row, so k-1 is always real."""
    previous = torch.cat([torch.zeros_like(scores[:, :1]), scores[:, :-1]], dim=-1)  # [B, K]
    return _masked(scores - previous, step_mask)


def min_form(scores: Tensor, step_mask: Tensor, temperature: float) -> Tensor:
    """w_k * s_k with w = softmax(-s / temperature) over each row's real steps."""
    if temperature <= 0:
        raise ValueError(f"reward.min_form_temperature={temperature} must be > 0")
    logits = (-scores / temperature).masked_fill(~step_mask, float("-inf"))  # [B, K]
    weights = torch.softmax(logits, dim=-1).nan_to_num(0.0)  # a row with no steps has no weights
    return _masked(weights * scores, step_mask)


def apply_transform(name: str, scores: Tensor, step_mask: Tensor, eta: float = 1.0,
                    temperature: float = 0.1) -> Tensor:
    """Per-step rewards [B, K] for step scores [B, K] under transform `name`."""
    step_mask = step_mask.bool()
    if name == "plain":
        return plain(scores, step_mask)
    if name == "centered":
        return centered(scores, step_mask)
    if name == "log":
        return log(scores, step_mask)
    if name == "clip":
        return clip(scores, step_mask, eta)
    if name == "delta":
        return delta(scores, step_mask)
    if name == "min_form":
        return min_form(scores, step_mask, temperature)
    raise ValueError(f"reward.transform={name!r} is not one of {', '.join(TRANSFORM_NAMES)}")
