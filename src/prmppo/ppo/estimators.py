"""Advantage estimators: GAE with decoupled lambdas, and the critic-free group baselines.

Pure functions of tensors under the conventions of `ppo/maths.py` (right-padded rows, a 0/1
`mask` [B, T] that is a prefix of each row, 0 on padding in every output). `ppo/advantages.py`
combines them with the KL pull into the advantages the update reads.

Simplifications: one value per token (no per-step values), episodes end at the last response
token (value 0 after it), `gamma` / `lam` are floats shared by the batch.

Tests: `pytest tests/ppo/test_estimators.py -q`.
"""

from __future__ import annotations

import torch
from torch import Tensor

from prmppo.ppo.maths import check_same_shape, check_unit_interval

GROUP_ESTIMATORS = ("rloo", "grpo")
ADVANTAGE_ESTIMATORS = ("gae", *GROUP_ESTIMATORS)  # ppo.advantage_estimator


def gae(rewards: Tensor, values: Tensor, mask: Tensor, gamma: float, lam: float,
        bootstrap: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Generalised advantage estimation (Schulman et al. 2016) on right-padded rows.

    delta_t = r_t + gamma * V_{t+1} - V_t, with V after the last real token of a row equal to
    `bootstrap[b]` (0 when omitted: the episode ended there, e.g. at EOS; a row cut at the length
    limit passes the value of the state at the cut, so the critic's estimate of what the response
    would have earned stands in for the missing tail); A_t = delta_t + gamma * lam * A_{t+1}.
    Returns (advantages, returns = advantages + values), both [B, T] and 0 on padding.
    The loop runs backwards over T and is vectorised over B. Each of its T steps is a few operations on [B]
    vectors, which on an accelerator are as many kernel launches the host makes one after another (about 7 T
    in all); there the whole computation runs on host copies and its results go back to the device. It is
    the same float32 additions and multiplications (each rounded exactly on either device), so the same bits.
    """
    check_same_shape(rewards=rewards, values=values, mask=mask)
    check_unit_interval("gamma", gamma)
    check_unit_interval("lam", lam)
    batch = values.shape[0]
    if bootstrap is not None and tuple(bootstrap.shape) != (batch,):
        raise ValueError(f"bootstrap shape {tuple(bootstrap.shape)} must be [B] = ({batch},)")
    device = values.device
    if device.type == "cpu":
        return _gae_rows(rewards, values, mask, gamma, lam, bootstrap)
    rewards, values, mask, bootstrap = (None if t is None else t.cpu() for t in (rewards, values, mask, bootstrap))
    return tuple(t.to(device) for t in _gae_rows(rewards, values, mask, gamma, lam, bootstrap))


def _gae_rows(rewards: Tensor, values: Tensor, mask: Tensor, gamma: float, lam: float,
              bootstrap: Tensor | None) -> tuple[Tensor, Tensor]:
    """`gae` on the device its arguments are on."""
    keep = mask.bool()
    m = keep.to(values.dtype)  # [B, T]
    zero = torch.zeros((), dtype=values.dtype, device=values.device)
    r = torch.where(keep, rewards.to(values.dtype), zero)  # [B, T]
    v = torch.where(keep, values, zero)  # [B, T]
    batch, horizon = v.shape
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


def _check_group_arguments(mask: Tensor, group_size: int, mode: str, std_floor: float, same_tol: float) -> None:
    """Refuse an unknown mode, groups of fewer than 2 samples, negative tolerances, or partial groups."""
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
    _check_group_arguments(mask, group_size, mode, std_floor, same_tol)
    advantages = torch.zeros(mask.shape, dtype=torch.float32, device=mask.device)  # [B, T]
    for values, events in terms:
        check_same_shape(values=values, events=events, mask=mask)
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


