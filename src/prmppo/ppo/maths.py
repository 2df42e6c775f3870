"""The PPO maths: masked reductions, GAE, clipped losses, loss aggregation, LR schedule.

Everything here is a pure function of tensors (no module state, no config, no device logic),
so the PPO loop reads like the algorithm and each piece is tested against hand-worked numbers
in `tests/ppo/test_maths.py`.

Conventions shared by every function:
- responses are right-padded; `mask` is a 0/1 float or bool tensor `[B, T]` with 1 on real
  response tokens, a contiguous prefix of each row;
- padded positions contribute nothing to any reduction and get 0 in every per-token output,
  even when the padded inputs hold garbage (inf / nan are masked with `torch.where`, not `* 0`);
- a reduction over an empty mask returns 0 (the count is clamped to 1), never nan, except
  `explained_variance`, which returns nan when it is undefined.

Simplifications: one value per token (no per-step values), episodes end at the last response
token (value 0 after it), `gamma` / `lam` are floats shared by the batch.

Run the tests: `PYTHONPATH=src pytest tests/ppo -q`.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import torch
from torch import Tensor

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


def _check_same_shape(**tensors: Tensor) -> None:
    """Refuse tensors whose shapes differ, naming each argument and its shape."""
    shapes = {name: tuple(t.shape) for name, t in tensors.items()}
    if len(set(shapes.values())) > 1:
        listed = ", ".join(f"{name}{shape}" for name, shape in shapes.items())
        raise ValueError(f"expected tensors of one shape [B, T], got {listed}")


def _check_unit_interval(name: str, value: float) -> None:
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
# advantages


def gae(rewards: Tensor, values: Tensor, mask: Tensor, gamma: float, lam: float,
        bootstrap: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Generalised advantage estimation (Schulman et al. 2016) on right-padded rows.

    delta_t = r_t + gamma * V_{t+1} - V_t, with V after the last real token of a row equal to
    `bootstrap[b]` (0 when omitted: the episode ended there, e.g. at EOS; a row cut at the length
    limit passes the value of the state at the cut, so the critic's estimate of what the response
    would have earned stands in for the missing tail); A_t = delta_t + gamma * lam * A_{t+1}.
    Returns (advantages, returns = advantages + values), both [B, T] and 0 on padding.
    The loop runs backwards over T (short) and is vectorised over B.
    """
    _check_same_shape(rewards=rewards, values=values, mask=mask)
    _check_unit_interval("gamma", gamma)
    _check_unit_interval("lam", lam)
    keep = mask.bool()
    m = keep.to(values.dtype)  # [B, T]
    zero = torch.zeros((), dtype=values.dtype, device=values.device)
    r = torch.where(keep, rewards.to(values.dtype), zero)  # [B, T]
    v = torch.where(keep, values, zero)  # [B, T]
    batch, horizon = v.shape
    if bootstrap is not None and tuple(bootstrap.shape) != (batch,):
        raise ValueError(f"bootstrap shape {tuple(bootstrap.shape)} must be [B] = ({batch},)")
    # the value after each row's last real token: `bootstrap` there, 0 on padding
    last = torch.zeros_like(keep)  # [B, T]
    lengths = keep.sum(-1)  # [B]
    has_tokens = lengths > 0
    last[has_tokens, lengths[has_tokens] - 1] = True
    tail = zero if bootstrap is None else bootstrap.to(values.dtype)[:, None]
    next_values = torch.where(last, tail, torch.roll(v, -1, dims=1) * torch.roll(m, -1, dims=1))  # [B, T]
    next_values[:, -1] = torch.where(last[:, -1], next_values[:, -1], zero)
    advantages = torch.zeros_like(v)  # [B, T]
    next_advantage = torch.zeros(batch, dtype=v.dtype, device=v.device)  # [B]
    for t in reversed(range(horizon)):
        # next_advantage is 0 past a row's last real token (masked below).
        delta = r[:, t] + gamma * next_values[:, t] - v[:, t]  # [B]
        advantage = (delta + gamma * lam * next_advantage) * m[:, t]  # [B]
        advantages[:, t] = advantage
        next_advantage = advantage
    returns = (advantages + v) * m  # [B, T]
    return advantages, returns


def decoupled_gae(rewards: Tensor, values: Tensor, mask: Tensor, gamma: float,
                  lam_actor: float, lam_critic: float, bootstrap: Tensor | None = None
                  ) -> tuple[Tensor, Tensor]:
    """GAE with separate lambdas for the policy and the critic; returns (advantages, value_targets).

    VC-PPO (Yuan et al. 2025, "What's Behind PPO's Collapse in Long-CoT? Value Optimization
    Holds the Secret"): value targets with lam_critic = 1 are unbiased Monte-Carlo returns, so
    the critic does not learn its own bias back over long responses, while a smaller lam_actor
    keeps the policy's advantages low-variance.
    """
    advantages, _ = gae(rewards, values, mask, gamma, lam_actor, bootstrap)
    _, value_targets = gae(rewards, values, mask, gamma, lam_critic, bootstrap)
    return advantages, value_targets


def returns_to_go(rewards: Tensor, mask: Tensor, gamma: float) -> Tensor:
    """G_t = sum_{s >= t} gamma^(s - t) r_s within each row; [B, T], 0 on padding."""
    rewards = rewards if rewards.is_floating_point() else rewards.float()
    return gae(rewards, torch.zeros_like(rewards), mask, gamma, 1.0)[0]


GROUP_ESTIMATORS = ("rloo", "grpo")


def group_baseline_advantages(terms, mask: Tensor, group_size: int, gamma: float, mode: str,
                              std_floor: float = 0.0, same_tol: float = 0.0) -> Tensor:
    """Critic-free advantages from the other samples of the same prompt; [B, T], 0 on padding.

    `terms` is a sequence of reward terms `(values [B, T], events [B, T] bool)`: the reward each
    term pays and the tokens where it can pay (a PRM's step ends; the outcome's last token). Rows
    are prompt-major: rows [g * group_size, (g + 1) * group_size) answer prompt g. Each term's
    rewards are compared like with like, *before* the return-to-go is taken, so that a step
    reward is judged against the other samples' step rewards and never against a whole-response
    total (which would credit position, not quality). For row i of a group, term rewards r_ik:

      rloo  r~_ik = r_ik - mean_{j != i} mean_k r_jk
            (per-step leave-one-out, PRIME: Cui et al. 2025, "Process Reinforcement through
            Implicit Rewards"; with one event per row, the outcome, it is RLOO, Ahmadian et al. 2024)
      grpo  r~_ik = (r_ik - mean(R)) / max(std(R) + 1e-6, std_floor), R = every event reward of
            the group (process supervision in DeepSeekMath's GRPO, Shao et al. 2024, section 4.1.3;
            with one event per row and no floor it is outcome GRPO)

    A_t = sum over the term's events s >= t of gamma^(s - t) r~_s, summed over terms.

    A group of identical samples (the same rewards at the same events) gets a zero total per row,
    and zero at every token only when each row's step rewards are flat: otherwise rloo leaves each
    step's deviation from the row's mean on the tokens between steps (grpo its deviation from the
    group's mean). `std_floor` (reward units, >= 0) keeps grpo from dividing tiny differences by a
    tiny std: step scores that differ by numerical jitter between identical samples would otherwise
    become advantages as large as a real contrast. A group of 0/1 outcomes with at least one right
    and one wrong sample has std >= 1/sqrt(n) (n samples), so a floor below that never changes it.
    `same_tol` (grpo, reward units, >= 0): a group whose samples pay this term at the same tokens with
    values within `same_tol` of each other (identical samples, scored with numerical jitter) is
    uniform: it gets no advantage from the term. Under grpo the std pooled over one response's steps
    is small, so its step-to-step profile would otherwise become advantages that no sample contrasts.
    """
    if mode not in GROUP_ESTIMATORS:
        raise ValueError(f"mode={mode!r}: valid modes are {', '.join(map(repr, GROUP_ESTIMATORS))}")
    if group_size < 2:
        raise ValueError(f"group_size={group_size}: a group baseline needs at least 2 samples per prompt")
    if not std_floor >= 0.0:
        raise ValueError(f"std_floor={std_floor!r} is invalid; it must be >= 0")
    if not same_tol >= 0.0:
        raise ValueError(f"same_tol={same_tol!r} is invalid; it must be >= 0")
    if mask.shape[0] % group_size:
        raise ValueError(f"{mask.shape[0]} rows are not a whole number of groups of {group_size}")
    advantages = torch.zeros(mask.shape, dtype=torch.float32, device=mask.device)  # [B, T]
    for values, events in terms:
        _check_same_shape(values=values, events=events, mask=mask)
        values = values if values.is_floating_point() else values.float()
        # group statistics in float64: identical samples then centre to exactly 0 (in float32 the mean of
        # equal scores can differ from them by an ulp, which a later normalisation would magnify)
        centred = _group_centred(values.double(), events.bool() & mask.bool(), group_size, mode, std_floor, same_tol)
        centred = centred.to(values.dtype)  # [B, T]
        advantages = advantages.to(centred.dtype) + returns_to_go(centred, mask, gamma)
    return advantages * mask.to(advantages.dtype)


def _group_centred(values: Tensor, events: Tensor, group_size: int, mode: str, std_floor: float = 0.0,
                   same_tol: float = 0.0) -> Tensor:
    """Each event reward minus its group baseline (and over the group std for grpo); 0 off events."""
    ev = events.to(values.dtype)  # [B, T]
    grouped = lambda x: x.reshape(-1, group_size, *x.shape[1:])  # noqa: E731  [G, n, ...]
    counts = ev.sum(-1)  # [B] events per row
    sums = (values * ev).sum(-1)  # [B]
    if mode == "rloo":
        has = (counts > 0).to(values.dtype)  # [B] rows that have an event of this term
        row_mean = sums / counts.clamp(min=1)  # [B]
        others = grouped(row_mean * has).sum(-1, keepdim=True) - grouped(row_mean * has)  # [G, n]
        n_others = grouped(has).sum(-1, keepdim=True) - grouped(has)  # [G, n]
        baseline = (others / n_others.clamp(min=1)).reshape(-1, 1)  # [B, 1]
        centred = values - baseline
    else:
        n = grouped(counts).sum(-1)  # [G]
        mean = grouped(sums).sum(-1) / n.clamp(min=1)  # [G]
        dev = (values - mean.repeat_interleave(group_size)[:, None]) * ev  # [B, T]
        var = grouped(dev.square().sum(-1)).sum(-1) / (n - 1).clamp(min=1)  # [G] unbiased, as torch.std
        std = var.sqrt().repeat_interleave(group_size)[:, None]  # [B, 1]
        centred = dev / (std + 1e-6).clamp(min=std_floor)
        if same_tol > 0:  # samples that pay at the same tokens within same_tol of the first: no contrast
            at = grouped(events)  # [G, n, T]
            gap = grouped(torch.where(events, values, torch.zeros_like(values)))  # [G, n, T]
            same = (at == at[:, :1]).all(-1).all(-1) & ((gap - gap[:, :1]).abs() <= same_tol).all(-1).all(-1)  # [G]
            centred = centred * (~same).repeat_interleave(group_size)[:, None].to(centred.dtype)
    return torch.where(events, centred, torch.zeros_like(centred))


def uniform_groups(outcome: Tensor, group_size: int) -> Tensor:
    """[G] bool: True for a prompt whose samples the verifier scored all right or all wrong.

    `outcome` is [B] (1 = right), rows prompt-major as in `group_baseline_advantages`. Such a
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
    _check_same_shape(logprobs=logprobs, old_logprobs=old_logprobs, advantages=advantages,
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
        big = torch.tensor(float("inf"), dtype=ratio.dtype, device=ratio.device)
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
    _check_same_shape(values=values, old_values=old_values, returns=returns, mask=mask)
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
    _check_same_shape(loss_per_token=loss_per_token, mask=mask)
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
# logits


def entropy_from_logits(logits: Tensor) -> Tensor:
    """Entropy [B, T] of softmax(logits [B, T, V]) as logsumexp(l) - sum_v p_v * l_v.

    Logits of -inf (masked vocabulary) contribute 0 instead of 0 * -inf = nan, and the
    replacement happens before the product, so the gradient stays finite too.
    """
    log_norm = torch.logsumexp(logits, dim=-1)  # [B, T]
    probs = torch.softmax(logits, dim=-1)  # [B, T, V]
    finite_logits = logits.masked_fill(probs == 0, 0.0)  # [B, T, V]
    return log_norm - (probs * finite_logits).sum(dim=-1)


def logprobs_from_logits(logits: Tensor, tokens: Tensor) -> Tensor:
    """log softmax(logits [B, T, V]) gathered at `tokens` [B, T] -> [B, T].

    Computed in float32 (half-precision logits are upcast): PPO ratios are exponentials of
    logprob differences, and bf16 rounding alone would move them by percent.
    """
    if tuple(logits.shape[:-1]) != tuple(tokens.shape):
        raise ValueError(f"tokens shape {tuple(tokens.shape)} must equal logits shape "
                         f"{tuple(logits.shape)} without its last (vocabulary) dimension")
    if logits.dtype in (torch.float16, torch.bfloat16):
        logits = logits.float()
    picked = torch.gather(logits, -1, tokens.long().unsqueeze(-1)).squeeze(-1)  # [B, T]
    return picked - torch.logsumexp(logits, dim=-1)


# ---------------------------------------------------------------------------------------------
# diagnostics and schedule


def explained_variance(values: Tensor, returns: Tensor, mask: Tensor) -> float:
    """1 - Var[R - V] / Var[R] over masked tokens (population variances).

    1 is a perfect critic, 0 one no better than predicting the mean, negative worse than that.
    Returns nan when Var[R] == 0 (e.g. every response got the same outcome): the quantity is
    undefined there, and nan is what a metrics logger should show rather than a made-up 0 or 1.
    """
    _check_same_shape(values=values, returns=returns, mask=mask)
    var_returns = masked_var(returns, mask)
    if var_returns.item() == 0.0:
        return float("nan")
    return (1.0 - masked_var(returns - values, mask) / var_returns).item()


def warmup_cosine(step: int, total_steps: int, warmup_steps: int, min_ratio: float) -> float:
    """LR multiplier at optimizer step `step` (0-based) of `total_steps`.

    Warmup: step in [0, warmup_steps) -> (step + 1) / warmup_steps, reaching 1 on its last step.
    Then cosine from 1 (at step = warmup_steps) down to `min_ratio` exactly at step
    total_steps - 1; when that phase has a single step, it is at min_ratio. Steps past the
    end return min_ratio (LambdaLR evaluates one step past the last optimizer step).
    """
    if total_steps < 1:
        raise ValueError(f"total_steps={total_steps!r} is invalid; it must be >= 1")
    if not 0 <= warmup_steps <= total_steps:
        raise ValueError(f"warmup_steps={warmup_steps!r} is invalid; it must lie in "
                         f"[0, total_steps={total_steps}]")
    _check_unit_interval("min_ratio", min_ratio)
    if step < 0:
        raise ValueError(f"step={step!r} is invalid; it must be >= 0")
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if step >= total_steps:
        return min_ratio
    decay_steps = total_steps - 1 - warmup_steps
    progress = (step - warmup_steps) / decay_steps if decay_steps > 0 else 1.0
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def make_scheduler(optimizer: torch.optim.Optimizer, total_steps: int, warmup_steps: int,
                   min_ratio: float) -> torch.optim.lr_scheduler.LambdaLR:
    """LambdaLR applying `warmup_cosine`; call `.step()` once per optimizer step."""
    warmup_cosine(0, total_steps, warmup_steps, min_ratio)  # refuse bad arguments now
    schedule = functools.partial(warmup_cosine, total_steps=total_steps,
                                 warmup_steps=warmup_steps, min_ratio=min_ratio)
    return torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
