"""Hand-worked checks of the per-token KL estimators and the in-reward KL penalty."""

from __future__ import annotations

import math

import pytest
import torch

from prmppo.rewards.kl import KL_ESTIMATORS, kl_estimate, kl_penalty_rewards

LN2 = math.log(2.0)
# r = logprobs - ref_logprobs = [0, ln 2, -ln 2]
LOGPROBS = torch.tensor([[-1.0, -1.0 + LN2, -1.0 - LN2]], dtype=torch.float64)
REF = torch.full_like(LOGPROBS, -1.0)


def close(actual, expected):
    torch.testing.assert_close(actual, torch.tensor(expected, dtype=torch.float64),
                               atol=1e-6, rtol=0)


def test_k1_is_the_log_ratio():
    close(kl_estimate(LOGPROBS, REF, "k1"), [[0.0, 0.693147, -0.693147]])


def test_k2_is_half_squared_log_ratio():
    # 0.5 * (ln 2)^2 = 0.5 * 0.480453 = 0.240227 for both signs
    close(kl_estimate(LOGPROBS, REF, "k2"), [[0.0, 0.240227, 0.240227]])


def test_k3_by_hand():
    # r = ln 2:  exp(-ln 2) - 1 + ln 2 = 0.5 - 1 + 0.693147 = 0.193147
    # r = -ln 2: exp(ln 2) - 1 - ln 2  = 2 - 1 - 0.693147   = 0.306853
    close(kl_estimate(LOGPROBS, REF, "k3"), [[0.0, 0.193147, 0.306853]])


def test_k3_is_never_negative():
    torch.manual_seed(0)
    log_ratio = torch.cat([torch.randn(1000, dtype=torch.float64) * 5,
                           torch.tensor([1e-9, -1e-9, 1e-4, -1e-4], dtype=torch.float64)])
    k3 = kl_estimate(log_ratio, torch.zeros_like(log_ratio), "k3")
    assert (k3 >= 0).all()
    k1 = kl_estimate(log_ratio, torch.zeros_like(log_ratio), "k1")
    assert (k1 < 0).any()  # the check above is not vacuous: k1 does go negative


def test_unknown_estimator_lists_the_valid_ones():
    assert KL_ESTIMATORS == ("k1", "k2", "k3")
    with pytest.raises(ValueError, match="'k4'.*k1, k2, k3"):
        kl_estimate(LOGPROBS, REF, "k4")


def test_kl_penalty_rewards_is_masked_and_scaled():
    logprobs = torch.cat([LOGPROBS, torch.tensor([[-1.0 + LN2, float("nan"), 5.0]],
                                                 dtype=torch.float64)])
    ref = torch.full_like(logprobs, -1.0)
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]], dtype=torch.bool)
    rewards = kl_penalty_rewards(logprobs, ref, mask, kl_coef=0.1, estimator="k3")
    # -0.1 * [0, 0.193147, 0.306853]; row 2: -0.1 * 0.193147 then padding 0 (even nan input)
    close(rewards, [[0.0, -0.0193147, -0.0306853], [-0.0193147, 0.0, 0.0]])
    with pytest.raises(ValueError, match="kl_coef=-0.1"):
        kl_penalty_rewards(logprobs, ref, mask, kl_coef=-0.1, estimator="k1")
