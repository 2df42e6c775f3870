"""Hand-worked checks of prmppo.ppo.maths; the arithmetic is written beside each assert."""

from __future__ import annotations

import math

import pytest
import torch

from prmppo.ppo.maths import (
    AGG_MODES,
    aggregate,
    explained_variance,
    masked_mean,
    masked_sum,
    masked_whiten,
    policy_loss,
    value_loss,
)

NAN = float("nan")


def t(rows):
    return torch.tensor(rows, dtype=torch.float64)


def close(actual, expected, atol=1e-6):
    torch.testing.assert_close(torch.as_tensor(actual, dtype=torch.float64),
                               torch.as_tensor(expected, dtype=torch.float64),
                               atol=atol, rtol=0)


# ----------------------------------------------------------------------------- policy loss

def one_token(ratio, adv, clip_low=0.2, clip_high=0.2, clip_c=None):
    logprobs = t([[math.log(ratio)]])
    loss, stats = policy_loss(logprobs, t([[0.0]]), t([[adv]]), t([[1.0]]),
                              clip_low, clip_high, clip_c, "token_mean")
    return loss.item(), stats


@pytest.mark.parametrize("ratio, adv, expected_loss, clipped", [
    (1.1, 2.0, -2.2, 0.0),   # inside: max(-2*1.1, -2*1.1) = -2.2
    (1.5, 2.0, -2.4, 1.0),   # above, A>0: max(-2*1.5=-3.0, -2*1.2=-2.4) = -2.4, clipped
    (0.5, 2.0, -1.0, 0.0),   # below, A>0: max(-2*0.5=-1.0, -2*0.8=-1.6) = -1.0, unclipped
    (1.1, -2.0, 2.2, 0.0),   # inside, A<0: 2*1.1 = 2.2
    (1.5, -2.0, 3.0, 0.0),   # above, A<0: max(2*1.5=3.0, 2*1.2=2.4) = 3.0, unclipped
    (0.5, -2.0, 1.6, 1.0),   # below, A<0: max(2*0.5=1.0, 2*0.8=1.6) = 1.6, clipped
])
def test_policy_loss_per_token_cases(ratio, adv, expected_loss, clipped):
    loss, stats = one_token(ratio, adv)
    close(loss, expected_loss)
    close(stats.clip_fraction, clipped)


def test_policy_loss_batch_mean_and_clip_fraction():
    ratios = [1.1, 1.5, 0.5, 1.1, 1.5, 0.5]
    logprobs = t([[math.log(r) for r in ratios] + [5.0]])  # last token is padding
    advantages = t([[2.0, 2.0, 2.0, -2.0, -2.0, -2.0, 100.0]])
    mask = t([[1, 1, 1, 1, 1, 1, 0]])
    loss, stats = policy_loss(logprobs, torch.zeros_like(logprobs), advantages, mask,
                              0.2, 0.2, None, "token_mean")
    # (-2.2 - 2.4 - 1.0 + 2.2 + 3.0 + 1.6) / 6 = 1.2 / 6 = 0.2
    close(loss, 0.2)
    close(stats.clip_fraction, 2 / 6)  # tokens 2 and 6
    close(stats.ratio_max, 1.5)  # the padded ratio e^5 is ignored
    close(stats.ratio_min, 0.5)


def test_policy_loss_asymmetric_clip():
    # clip_low = 0.2, clip_high = 0.28 -> range [0.8, 1.28]
    loss, stats = one_token(1.25, 1.0, 0.2, 0.28)
    close(loss, -1.25)  # inside the wider upper range (would be clipped at 1.2 symmetric)
    close(stats.clip_fraction, 0.0)
    loss, stats = one_token(1.5, 1.0, 0.2, 0.28)
    close(loss, -1.28)  # max(-1.5, -1.28)
    close(stats.clip_fraction, 1.0)
    loss, _ = one_token(0.5, -1.0, 0.2, 0.28)
    close(loss, 0.8)  # max(0.5, 0.8): lower bound is 1 - 0.2


def test_policy_loss_dual_clip_caps_negative_advantage():
    loss, stats = one_token(5.0, -1.0, clip_c=3.0)
    # max(1*5, 1*1.2) = 5, capped at -clip_c * A = 3
    close(loss, 3.0)
    close(stats.dual_clip_fraction, 1.0)
    close(one_token(2.0, -1.0, clip_c=3.0)[0], 2.0)  # 2 < 3: not capped
    close(one_token(5.0, 1.0, clip_c=3.0)[0], -1.2)  # A > 0: dual clip does not apply
    # a capped token has no gradient
    logprobs = t([[math.log(5.0)]]).requires_grad_()
    loss, _ = policy_loss(logprobs, t([[0.0]]), t([[-1.0]]), t([[1.0]]), 0.2, 0.2, 3.0,
                          "token_mean")
    loss.backward()
    close(logprobs.grad, [[0.0]])


@pytest.mark.parametrize("clip_c", [1.0, 0.5])
def test_policy_loss_refuses_clip_c_not_above_one(clip_c):
    with pytest.raises(ValueError, match=f"clip_c={clip_c}"):
        one_token(1.0, 1.0, clip_c=clip_c)


def test_policy_stats_at_ratio_one():
    logprobs = t([[-1.3, -0.2, -2.0], [-0.7, -4.0, -9.0]])
    old = logprobs.clone()
    old[1, 2] = 3.0  # padding: ratio e^-12 would show up in ratio_min if not masked
    mask = t([[1, 1, 1], [1, 1, 0]])
    _, stats = policy_loss(logprobs, old, torch.randn(2, 3, dtype=torch.float64), mask,
                           0.2, 0.2, 3.0, "token_mean")
    close(stats.ratio_mean, 1.0)
    close(stats.ratio_max, 1.0)
    close(stats.ratio_min, 1.0)
    close(stats.clip_fraction, 0.0)
    close(stats.approx_kl, 0.0)


def test_policy_stats_approx_kl_and_ratio_mean():
    logprobs = t([[0.2, -0.4, 7.0]])
    mask = t([[1, 1, 0]])
    _, stats = policy_loss(logprobs, torch.zeros_like(logprobs), torch.ones_like(logprobs),
                           mask, 0.2, 0.2, None, "token_mean")
    # k2: 0.5 * (0.2^2 + 0.4^2) / 2 = 0.5 * 0.2 / 2 = 0.05
    close(stats.approx_kl, 0.05)
    # (e^0.2 + e^-0.4) / 2 = (1.221403 + 0.670320) / 2 = 0.945861
    close(stats.ratio_mean, 0.945861)
    assert not stats.approx_kl.requires_grad


# ------------------------------------------------------------------------------ value loss

V = t([[1.0, 1.5, 0.0, 3.0]])
V_OLD = t([[1.0, 1.0, 0.5, 1.0]])
RET = t([[2.0, 2.0, 0.0, 0.0]])


def test_value_loss_clipped_by_hand():
    loss, clip_fraction = value_loss(V, V_OLD, RET, torch.ones_like(V), 0.2, "token_mean")
    # t0: v = old = 1 -> both (1-2)^2 = 1                         -> 0.5
    # t1: clip(1.5, 0.8, 1.2) = 1.2: max(0.5^2, 0.8^2 = 0.64)      -> 0.32  (clipped)
    # t2: clip(0, 0.3, 0.7) = 0.3:   max(0, 0.3^2 = 0.09)          -> 0.045 (clipped)
    # t3: clip(3, 0.8, 1.2) = 1.2:   max(9, 1.44)                  -> 4.5
    # mean = (0.5 + 0.32 + 0.045 + 4.5) / 4 = 5.365 / 4 = 1.34125
    close(loss, 1.34125)
    close(clip_fraction, 0.5)


def test_value_loss_unclipped_by_hand():
    loss, clip_fraction = value_loss(V, V_OLD, RET, torch.ones_like(V), None, "token_mean")
    # 0.5 * (1 + 0.25 + 0 + 9) / 4 = 5.125 / 4 = 1.28125
    close(loss, 1.28125)
    close(clip_fraction, 0.0)


def test_value_loss_ignores_padding():
    mask = t([[1, 1, 1, 0]])
    loss, clip_fraction = value_loss(V, V_OLD, RET, mask, 0.2, "token_mean")
    # (0.5 + 0.32 + 0.045) / 3 = 0.865 / 3; clipped 2 of 3
    close(loss, 0.865 / 3)
    close(clip_fraction, 2 / 3)


# ------------------------------------------------------------------------------- aggregate

LOSS = t([[1.0, 2.0, 3.0], [4.0, 5.0, 99.0]])
MASK = t([[1, 1, 1], [1, 1, 0]])


def test_aggregate_modes_by_hand():
    # token_mean: (1 + 2 + 3 + 4 + 5) / 5 = 3
    close(aggregate(LOSS, MASK, "token_mean"), 3.0)
    # seq_mean_token_mean: row means 6/3 = 2 and 9/2 = 4.5 -> (2 + 4.5) / 2 = 3.25
    close(aggregate(LOSS, MASK, "seq_mean_token_mean"), 3.25)
    # seq_mean_token_sum_norm, norm 4: 6/4 = 1.5 and 9/4 = 2.25 -> 1.875
    close(aggregate(LOSS, MASK, "seq_mean_token_sum_norm", norm_length=4), 1.875)
    # with global_seq_count = 4: (2 + 4.5) / 4 = 1.625; (1.5 + 2.25) / 4 = 0.9375
    close(aggregate(LOSS, MASK, "seq_mean_token_mean", global_seq_count=4), 1.625)
    close(aggregate(LOSS, MASK, "seq_mean_token_sum_norm", global_seq_count=4, norm_length=4),
          0.9375)
    # global_token_count = 10: 15 / 10
    close(aggregate(LOSS, MASK, "token_mean", global_token_count=10), 1.5)


def test_aggregate_empty_row_is_not_a_sequence():
    loss = torch.cat([LOSS, t([[7.0, 7.0, 7.0]])])
    mask = torch.cat([MASK, t([[0, 0, 0]])])
    close(aggregate(loss, mask, "seq_mean_token_mean"), 3.25)  # still (2 + 4.5) / 2
    close(aggregate(loss, mask, "token_mean"), 3.0)


def test_micro_batches_with_global_token_count_sum_to_full_token_mean():
    torch.manual_seed(0)
    loss = torch.randn(6, 5, dtype=torch.float64)
    lengths = torch.tensor([5, 1, 3, 2, 4, 5])
    mask = (torch.arange(5)[None, :] < lengths[:, None]).double()  # [6, 5]
    full = aggregate(loss, mask, "token_mean")
    total = mask.sum().item()  # 20 tokens
    halves = [aggregate(loss[rows], mask[rows], "token_mean", global_token_count=total)
              for rows in (slice(0, 3), slice(3, 6))]
    close(halves[0] + halves[1], full, atol=1e-12)
    # by hand on LOSS: rows 1 and 2 are micro-batches of 6 and 9 over 5 tokens: 1.2 + 1.8 = 3
    parts = [aggregate(LOSS[i:i + 1], MASK[i:i + 1], "token_mean", global_token_count=5)
             for i in (0, 1)]
    close(parts[0] + parts[1], 3.0)
    # whereas averaging per-micro-batch means is biased: (2 + 4.5) / 2 = 3.25 != 3
    naive = [aggregate(LOSS[i:i + 1], MASK[i:i + 1], "token_mean") for i in (0, 1)]
    close((naive[0] + naive[1]) / 2, 3.25)


def test_aggregate_errors_name_the_argument():
    with pytest.raises(ValueError, match="token_mean, seq_mean_token_mean, "
                                         "seq_mean_token_sum_norm") as info:
        aggregate(LOSS, MASK, "sum")
    assert "'sum'" in str(info.value)
    assert AGG_MODES == ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm")
    with pytest.raises(ValueError, match="norm_length"):
        aggregate(LOSS, MASK, "seq_mean_token_sum_norm")
    with pytest.raises(ValueError, match="global_token_count=0"):
        aggregate(LOSS, MASK, "token_mean", global_token_count=0)


# ---------------------------------------------------------------------- masked reductions

def test_masked_sum_and_mean_ignore_padding_garbage():
    x = t([[1.0, 2.0, NAN], [3.0, float("inf"), 5.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 1]], dtype=torch.bool)
    close(masked_sum(x, mask), 11.0)  # 1 + 2 + 3 + 5
    close(masked_mean(x, mask), 2.75)  # 11 / 4
    close(masked_mean(x, mask, dim=-1), [1.5, 4.0])  # 3/2, 8/2


def test_masked_whiten_by_hand_and_statistics():
    x = t([[1.0, 2.0, 3.0, 50.0]])
    mask = t([[1, 1, 1, 0]])
    # mean 2, var ((1)^2 + 0 + 1^2) / 3 = 2/3, std 0.816497 -> [-1.224745, 0, 1.224745]
    close(masked_whiten(x, mask), [[-1.224745, 0.0, 1.224745, 0.0]])
    # shift_mean=False adds the mean 2 back on real tokens
    close(masked_whiten(x, mask, shift_mean=False), [[0.775255, 2.0, 3.224745, 0.0]])
    torch.manual_seed(1)
    y = torch.randn(4, 6, dtype=torch.float64) * 3 + 7
    lengths = torch.tensor([6, 2, 4, 1])
    m = (torch.arange(6)[None, :] < lengths[:, None])
    w = masked_whiten(y, m)
    close(masked_mean(w, m), 0.0)
    close(masked_mean(w * w, m), 1.0)  # population variance 1
    assert (w[~m] == 0).all()


# ------------------------------------------------------------------------------ diagnostics

def test_explained_variance_by_hand():
    returns = t([[1.0, 2.0, 3.0, 9.0]])
    mask = t([[1, 1, 1, 0]])
    # R - V = [0, 0, -1]: mean -1/3, var ((1/3)^2 * 2 + (2/3)^2) / 3 = (6/9) / 3 = 2/9
    # Var R = 2/3 -> 1 - (2/9) / (2/3) = 2/3
    close(explained_variance(t([[1.0, 2.0, 4.0, 0.0]]), returns, mask), 2 / 3)
    close(explained_variance(returns, returns, mask), 1.0)
    close(explained_variance(torch.zeros_like(returns), returns, mask), 0.0)
    assert math.isnan(explained_variance(returns, t([[5.0, 5.0, 5.0, 1.0]]), mask))
