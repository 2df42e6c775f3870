"""The PPO maths: masked reductions, clipped losses, loss aggregation, diagnostics.

Everything here is a pure function of tensors (no module state, no config, no device logic),
so the PPO loop reads like the algorithm and each piece is tested against hand-worked numbers
in `tests/ppo/test_maths.py`. The advantage estimators (GAE, the group baselines) are in
`ppo/estimators.py`, built on the reductions here; logprobs and entropies from logits in
`models/token_scores.py`, the LR schedule in `prmppo/optim.py` (both importable from here too).

Conventions shared by every function:
- responses are right-padded; `mask` is a 0/1 float or bool tensor `[B, T]` with 1 on real
  response tokens, a contiguous prefix of each row;
- padded positions contribute nothing to any reduction and get 0 in every per-token output,
  even when the padded inputs hold garbage (inf / nan are masked with `torch.where`, not `* 0`);
- a reduction over an empty mask returns 0 (the count is clamped to 1), never nan, except
  `explained_variance`, which returns nan when it is undefined.

Run the tests: `PYTHONPATH=src pytest tests/ppo -q`.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

# importable from here as before (the SFT and PRM stages, the PPO loop and the benchmarks read them so);
# their homes are the modules SFT, PRM and PPO share
from prmppo.models.token_scores import entropy_from_logits, logprobs_from_logits  # noqa: F401
from prmppo.optim import make_scheduler  # noqa: F401

AGG_MODES = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm")


class PolicyStats(NamedTuple):
    """Diagnostics of one policy-loss call; detached 0-dim tensors (no host sync forced)."""

    clip_fraction: Tensor  # fraction of masked tokens where the clipped branch was active
    approx_kl: Tensor  # masked mean of 0.5 * (logprobs - old_logprobs)^2 (k2 estimator)
    ratio_mean: Tensor
    ratio_max: Tensor
    ratio_min: Tensor
    dual_clip_fraction: Tensor  # fraction of masked tokens capped by the dual clip (0 if off)


# ---------------------------------------------------------------------------------------------
# argument checks


def check_same_shape(**tensors: Tensor) -> None:
    """Refuse tensors whose shapes differ, naming each argument and its shape."""
    shapes = {name: tuple(t.shape) for name, t in tensors.items()}
    if len(set(shapes.values())) > 1:
        listed = ", ".join(f"{name}{shape}" for name, shape in shapes.items())
        raise ValueError(f"expected tensors of one shape [B, T], got {listed}")


def check_unit_interval(name: str, value: float) -> None:
    if not 0.0 <= value <= 1.0:
        raise ValueError(f"{name}={value!r} is invalid; it must lie in [0, 1]")


# ---------------------------------------------------------------------------------------------
# masked reductions


def masked_sum(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Sum of `x` over positions where `mask` is 1 (over all of them when `dim` is None)."""
    kept = torch.where(mask.bool(), x, torch.zeros((), dtype=x.dtype, device=x.device))
    return kept.sum() if dim is None else kept.sum(dim=dim)


def masked_mean(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Mean of `x` over masked positions; 0 where the mask is empty (count clamped to 1)."""
    count = masked_sum(torch.ones_like(x), mask, dim)
    return masked_sum(x, mask, dim) / count.clamp(min=1.0)


def masked_var(x: Tensor, mask: Tensor) -> Tensor:
    """Population variance (unbiased=False) of `x` over all masked positions, 0-dim."""
    centred = x - masked_mean(x, mask)
    return masked_mean(centred * centred, mask)


def masked_whiten(x: Tensor, mask: Tensor, shift_mean: bool = True, eps: float = 1e-8) -> Tensor:
    """(x - mean) / sqrt(var + eps) with mean / var over masked entries; padding is 0.

    `shift_mean=False` adds the mean back: the scale is normalised, the sign of each entry
    relative to zero is not (used for advantages whose mean carries signal).
    """
    mean = masked_mean(x, mask)
    whitened = (x - mean) * torch.rsqrt(masked_var(x, mask) + eps)
    if not shift_mean:
        whitened = whitened + mean
    return torch.where(mask.bool(), whitened, torch.zeros_like(whitened))


def masked_rescale(x: Tensor, mask: Tensor, eps: float = 1e-8) -> Tensor:
    """x / sqrt(var + eps), var over masked entries; padding is 0. No shift: a zero stays zero."""
    scaled = x * torch.rsqrt(masked_var(x, mask) + eps)
    return torch.where(mask.bool(), scaled, torch.zeros_like(scaled))


# ---------------------------------------------------------------------------------------------
# groups


def uniform_groups(outcome: Tensor, group_size: int) -> Tensor:
    """[G] bool: True for a prompt whose samples the verifier scored all right or all wrong.

    `outcome` is [B] (1 = right), rows prompt-major as in `estimators.group_baseline_advantages`. Such a
    group has no outcome contrast to learn from (DAPO's dynamic sampling, Yu et al. 2025, "DAPO:
    An Open-Source LLM Reinforcement Learning System at Scale", drops them from the batch).
    """
    if outcome.dim() != 1 or group_size < 1 or outcome.shape[0] % group_size:
        raise ValueError(f"outcome of shape {tuple(outcome.shape)} is not a [B] vector of whole groups "
                         f"of {group_size}")
    right = outcome.reshape(-1, group_size) > 0.5  # [G, n]
    return right.all(-1) | (~right).all(-1)


# ---------------------------------------------------------------------------------------------
# losses


def policy_loss(logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, mask: Tensor,
                clip_low: float, clip_high: float, clip_c: float | None, agg: str, *,
                global_token_count: float | None = None, global_seq_count: float | None = None,
                norm_length: float | None = None) -> tuple[Tensor, PolicyStats]:
    """PPO clipped surrogate with asymmetric clip range and optional dual clip.

    ratio = exp(logprobs - old_logprobs); per token
    loss = max(-A * ratio, -A * clip(ratio, 1 - clip_low, 1 + clip_high)).
    Dual clip (Ye et al. 2020, "Mastering Complex Control in MOBA Games with Deep RL"): when
    `clip_c` is set, tokens with A < 0 are capped at -clip_c * A, so a huge ratio on a bad
    action cannot dominate the batch (its gradient is then 0). The keyword arguments are passed
    to `aggregate`. `approx_kl` is the k2 estimator 0.5 * log_ratio^2 (Schulman 2020): always
    >= 0 and close to KL(old || new) for small steps.
    """
    check_same_shape(logprobs=logprobs, old_logprobs=old_logprobs, advantages=advantages,
                      mask=mask)
    if not 0.0 <= clip_low < 1.0:
        raise ValueError(f"clip_low={clip_low!r} is invalid; it must lie in [0, 1)")
    if clip_high < 0.0:
        raise ValueError(f"clip_high={clip_high!r} is invalid; it must be >= 0")
    if clip_c is not None and not clip_c > 1.0:
        raise ValueError(f"clip_c={clip_c!r} is invalid; the dual clip needs clip_c > 1, or None "
                         "to turn it off")
    keep = mask.bool()
    zero = torch.zeros((), dtype=logprobs.dtype, device=logprobs.device)
    log_ratio = torch.where(keep, logprobs - old_logprobs, zero)  # [B, T]
    adv = torch.where(keep, advantages.to(logprobs.dtype), zero)  # [B, T]
    ratio = torch.exp(log_ratio)  # [B, T]
    unclipped = -adv * ratio  # [B, T]
    clipped = -adv * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)  # [B, T]
    per_token = torch.maximum(unclipped, clipped)  # [B, T]
    dual_active = torch.zeros_like(keep)  # [B, T]
    if clip_c is not None:
        cap = -clip_c * adv  # [B, T]
        dual_active = (adv < 0) & (per_token > cap)
        per_token = torch.where(dual_active, cap, per_token)
    loss = aggregate(per_token, mask, agg, global_token_count=global_token_count,
                     global_seq_count=global_seq_count, norm_length=norm_length)
    with torch.no_grad():
        big = torch.full((), float("inf"), dtype=ratio.dtype, device=ratio.device)  # a fill: no copy from the host
        stats = PolicyStats(
            clip_fraction=masked_mean((clipped > unclipped).to(ratio.dtype), mask),
            approx_kl=masked_mean(0.5 * log_ratio.square(), mask),
            ratio_mean=masked_mean(ratio, mask),
            ratio_max=torch.where(keep, ratio, -big).max(),
            ratio_min=torch.where(keep, ratio, big).min(),
            dual_clip_fraction=masked_mean(dual_active.to(ratio.dtype), mask),
        )
    return loss, PolicyStats(*(s.detach() for s in stats))


def value_loss(values: Tensor, old_values: Tensor, returns: Tensor, mask: Tensor,
               clip_range: float | None, agg: str, *, global_token_count: float | None = None,
               global_seq_count: float | None = None, norm_length: float | None = None
               ) -> tuple[Tensor, Tensor]:
    """Clipped value loss; returns (loss, clip_fraction as a detached 0-dim tensor).

    With `clip_range` = eps: 0.5 * max((v - R)^2, (clip(v, old - eps, old + eps) - R)^2), so the
    critic cannot move far from `old_values` in one update; without it 0.5 * (v - R)^2.
    clip_fraction is the fraction of masked tokens where the clipped term is the larger one.
    """
    check_same_shape(values=values, old_values=old_values, returns=returns, mask=mask)
    if clip_range is not None and not clip_range > 0.0:
        raise ValueError(f"clip_range={clip_range!r} is invalid; it must be > 0, or None to "
                         "turn value clipping off")
    unclipped = (values - returns).square()  # [B, T]
    if clip_range is None:
        per_token = 0.5 * unclipped
        clip_active = torch.zeros_like(mask, dtype=torch.bool)
    else:
        near_old = torch.clamp(values, old_values - clip_range, old_values + clip_range)
        clipped = (near_old - returns).square()  # [B, T]
        per_token = 0.5 * torch.maximum(unclipped, clipped)
        clip_active = clipped > unclipped
    loss = aggregate(per_token, mask, agg, global_token_count=global_token_count,
                     global_seq_count=global_seq_count, norm_length=norm_length)
    clip_fraction = masked_mean(clip_active.to(values.dtype), mask).detach()
    return loss, clip_fraction


def aggregate(loss_per_token: Tensor, mask: Tensor, mode: str,
              global_token_count: float | None = None, global_seq_count: float | None = None,
              norm_length: float | None = None) -> Tensor:
    """Reduce a [B, T] per-token loss to a scalar; `mode` is one of AGG_MODES.

    - `token_mean`: sum over masked tokens / number of masked tokens. With
      `global_token_count` (the masked-token count of the whole minibatch, over ALL
      micro-batches and ranks) the sum is divided by it instead, so summing the micro-batch
      losses (gradient accumulation, and the sum that data-parallel gradient all-reduce
      performs) gives exactly the minibatch token mean.
    - `seq_mean_token_mean`: each sequence's mean over its tokens, then the mean over sequences
      (or the sum / `global_seq_count`).
    - `seq_mean_token_sum_norm`: each sequence's token sum / the constant `norm_length`
      (Dr. GRPO, Liu et al. 2025, "Understanding R1-Zero-Like Training": no length bias), then
      the mean over sequences (or the sum / `global_seq_count`).
    A row with no masked token (a batch-filler row) is not counted as a sequence; callers that
    pass `global_seq_count` must count the same way: `(mask.sum(-1) > 0).sum()`.
    """
    check_same_shape(loss_per_token=loss_per_token, mask=mask)
    if mode not in AGG_MODES:
        raise ValueError(f"agg mode {mode!r} is unknown; valid modes are {', '.join(AGG_MODES)}")
    for name, value in (("global_token_count", global_token_count),
                        ("global_seq_count", global_seq_count), ("norm_length", norm_length)):
        if value is not None and not value > 0:
            raise ValueError(f"{name}={value!r} is invalid; it must be > 0 (or None)")
    if mode == "token_mean":
        if global_token_count is None:
            return masked_mean(loss_per_token, mask)
        return masked_sum(loss_per_token, mask) / global_token_count
    token_sums = masked_sum(loss_per_token, mask, dim=-1)  # [B]
    token_counts = masked_sum(torch.ones_like(loss_per_token), mask, dim=-1)  # [B]
    if mode == "seq_mean_token_mean":
        per_seq = token_sums / token_counts.clamp(min=1.0)  # [B]
    else:
        if norm_length is None:
            raise ValueError("agg mode 'seq_mean_token_sum_norm' needs norm_length (a constant "
                             "number of tokens, e.g. max_new_tokens); got None")
        per_seq = token_sums / norm_length  # [B]
    if global_seq_count is not None:
        return per_seq.sum() / global_seq_count
    return per_seq.sum() / (token_counts > 0).sum().clamp(min=1)


# ---------------------------------------------------------------------------------------------
# diagnostics


def explained_variance(values: Tensor, returns: Tensor, mask: Tensor) -> float:
    """1 - Var[R - V] / Var[R] over masked tokens (population variances).

    1 is a perfect critic, 0 one no better than predicting the mean, negative worse than that.
    Returns nan when Var[R] == 0 (e.g. every response got the same outcome): the quantity is
    undefined there, and nan is what a metrics logger should show rather than a made-up 0 or 1.
    """
    check_same_shape(values=values, returns=returns, mask=mask)
    var_returns = masked_var(returns, mask)
    if var_returns.item() == 0.0:
        return float("nan")
    return (1.0 - masked_var(returns - values, mask) / var_returns).item()
