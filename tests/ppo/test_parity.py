"""Parity of prmppo's PPO maths with numbers published in other frameworks' test suites.

Each test takes the inputs and expected values (facts only, no code) from one named test of a
peer framework, cites it as `repo path::test`, and says how their conventions map onto ours.
Where no peer publishes a literal number (the clipped value loss, the active lower clip bound of
an asymmetric clip) the test says so and derives the value by hand in the comment.

Peer snapshots read (commit, date):
  pytorch/torchtune   bd2a0fc7 (2026-04-23)
  NVIDIA-NeMo/RL      7ea279ab (2026-08-22)
  NovaSky-AI/SkyRL    a9564572 (2026-08-21)
  thu-ml/tianshou     f2402056 (2026-04-03)
verl (b178a3cd), OpenRLHF (3c3be623), TRL (f2cd5771) and AReaL (4aef98d8) were read too: their
PPO-maths tests compare two implementations or check shapes / signs, with no literal numbers.

Shared conventions of ours that matter below: right padding; V = 0 after a row's last real token
(`bootstrap` omitted); per-token policy loss max(-A r, -A clip(r, 1 - clip_low, 1 + clip_high)), with
the dual clip capping A < 0 tokens at -clip_c * A; value loss 0.5 * max((v - R)^2,
(clip(v, old +- eps) - R)^2); KL estimators on r = logprobs - ref_logprobs.
"""

from __future__ import annotations

import math

import pytest
import torch

from prmppo.ppo.estimators import gae
from prmppo.ppo.maths import policy_loss, value_loss
from prmppo.rewards.kl import kl_estimate, kl_penalty_rewards


def t(rows):
    return torch.tensor(rows, dtype=torch.float64)


def close(actual, expected, atol):
    torch.testing.assert_close(torch.as_tensor(actual, dtype=torch.float64),
                               torch.as_tensor(expected, dtype=torch.float64),
                               atol=atol, rtol=0)


# ----------------------------------------------------------------------------------- GAE

def test_gae_returns_match_torchtune():
    # torchtune tests/torchtune/rlhf/test_rewards.py::TestEstimateAdvantages::test_estimate_returns
    # values = rewards = [[0, 0, 0, 1]], gamma = 0.9, lambda = 0.95; expected returns
    # [g^3 l^2, g^2 l, g, 1] * final_reward (1.0). Their GAE also takes V = 0 after the last
    # token. They whiten the advantages inside estimate_advantages but not the returns, so the
    # returns compare exactly; our (unwhitened) advantages are returns - values.
    gamma, lam = 0.9, 0.95
    values = t([[0.0, 0.0, 0.0, 1.0]])
    rewards = t([[0.0, 0.0, 0.0, 1.0]])
    adv, ret = gae(rewards, values, torch.ones(1, 4), gamma, lam)
    expected = [[gamma ** 3 * lam ** 2, gamma ** 2 * lam, gamma, 1.0]]  # [.6579225, .7695, .9, 1]
    close(ret, expected, atol=1e-4)  # their tolerance
    close(adv, t(expected) - values, atol=1e-4)
    # Not used: ...::test_estimate_advantages_with_masks lets the masked last position feed V and r
    # into the recursion (ours ends the episode at the last real token) and whitens with a
    # Bessel-corrected variance (ours is the population variance): a convention difference.


def test_gae_returns_match_tianshou_three_episodes():
    # tianshou test/base/test_returns.py::test_episodic_returns (4th case): one flat buffer of
    # three terminated 4-step episodes, rew = [101, 102, 103, 200 | 104, 105, 106, 201 |
    # 107, 108, 109, 202], v = [2, 3, 4, -1, 5, 6, 7, -2, 8, 9, 10, -3], gamma = 0.99,
    # gae_lambda = 0.95, published returns below (4 decimals).
    # Mapping: their v is V(s') per step; V(s') is zeroed on terminated steps and
    # V(s) = roll(V(s'), 1). So per episode V(s) = [0, 2, 3, 4], [0, 5, 6, 7], [0, 8, 9, 10] (each
    # leading 0 is the previous episode's zeroed terminal V(s'); the first one wraps around from
    # the last step, also terminal) and V = 0 after the last step: exactly one row each here.
    rewards = t([[101, 102, 103, 200], [104, 105, 106, 201], [107, 108, 109, 202]])
    values = t([[0, 2, 3, 4], [0, 5, 6, 7], [0, 8, 9, 10]])
    _, ret = gae(rewards, values, torch.ones(3, 4), 0.99, 0.95)
    close(ret, [[454.8344, 376.1143, 291.298, 200.0],
                [464.5610, 383.1085, 295.387, 201.0],
                [474.2876, 390.1027, 299.476, 202.0]], atol=1e-4)


@pytest.mark.parametrize("gamma, lam, expected_returns", [
    # NovaSky-AI/SkyRL tests/backends/skyrl_train/utils/test_ppo_utils.py::
    #   test_compute_gae_advantage_return_gamma  (gamma 0.5, lambda 1)
    (0.5, 1.0, [[2.75, 3.5, 3.0]]),
    #   test_compute_gae_advantage_return_lam    (gamma 1, lambda 0.5)
    (1.0, 0.5, [[3.625, 4.25, 3.0]]),
])
def test_gae_returns_match_skyrl(gamma, lam, expected_returns):
    # SkyRL fixture advantage_test_data: rewards [[1, 2, 3]], values [[0.5, 1, 1.5]], full mask.
    # Their advantages are whitened, their returns are not: only the returns are published.
    _, ret = gae(t([[1.0, 2.0, 3.0]]), t([[0.5, 1.0, 1.5]]), torch.ones(1, 3), gamma, lam)
    close(ret, expected_returns, atol=1e-5)  # their tolerance


def test_gae_lambda_zero_matches_nemo_rl():
    # NVIDIA-NeMo/RL tests/unit/algorithms/test_ppo.py::test_gae_gamma_lambda_zero
    # Scalar reward 5.0 placed on the last token -> token rewards [0, 0, 5]; values [1, 2, 3];
    # gamma 1, lambda 0 -> A = one-step TD errors [1, 1, 2] (next value 0 at the end).
    adv, ret = gae(t([[0.0, 0.0, 5.0]]), t([[1.0, 2.0, 3.0]]), torch.ones(1, 3), 1.0, 0.0)
    close(adv, [[1.0, 1.0, 2.0]], atol=1e-6)
    close(ret, [[2.0, 3.0, 5.0]], atol=1e-6)  # A + V (their test checks only A)


# ----------------------------------------------------------------------------- policy loss

# NeMo-RL's tests set current logprobs to log(ratio) + prev with 5-decimal constants, so their
# ratios are 0.5, 1.0, 1.5 / 10.0 up to ~1e-5; they assert with rtol 1e-3 (we use atol 1e-4).
# Their token_mask masks one leading slot (the loss is on logits[:, :-1]); ours is right-padded,
# so the masked slot moves to the end, filled with garbage that must not count.

def _nemo(values, pad):
    return t([values + [pad]])


NEMO_MASK = t([[1.0, 1.0, 1.0, 0.0]])


def test_policy_loss_symmetric_clip_matches_nemo_rl():
    # NVIDIA-NeMo/RL tests/unit/algorithms/test_loss_functions.py::test_clipped_pg_loss_ppo_clipping
    # A = [1, -1, 2], prev = [-1, -1, -1], curr = [-1.69315, -1.0, -0.59453] (ratios .5, 1, 1.5),
    # default ratio_clip_min = ratio_clip_max = 0.2; per token max = [-0.5, 1.0, -2.4], the
    # token mean (their global_valid_toks = 3) = -0.6333.
    logprobs = _nemo([-1.69315, -1.0, -0.59453], pad=7.0)
    old = _nemo([-1.0, -1.0, -1.0], pad=0.0)
    adv = _nemo([1.0, -1.0, 2.0], pad=100.0)
    loss, stats = policy_loss(logprobs, old, adv, NEMO_MASK, 0.2, 0.2, None, "token_mean")
    close(loss, -0.6333, atol=1e-4)
    # (not published) only the third token takes the clipped branch
    close(stats.clip_fraction, 1 / 3, atol=1e-9)


def test_policy_loss_clipped_high_matches_torchtune():
    # torchtune tests/torchtune/rlhf/loss/test_ppo_loss.py::TestPPOLoss::
    #   test_policy_loss_clipped_for_high_logprobs
    # old = [0.5, 0.8, 1.2], new = [1.5, 1.8, 2.2] (ratio e each), A = 1, epsilon 0.2, mean
    # over the 3 tokens -> max(-e, -1.2) = -1.2.
    loss, stats = policy_loss(t([[1.5, 1.8, 2.2]]), t([[0.5, 0.8, 1.2]]), t([[1.0, 1.0, 1.0]]),
                              torch.ones(1, 3), 0.2, 0.2, None, "token_mean")
    close(loss, -1.2, atol=1e-4)
    close(stats.ratio_mean, math.e, atol=1e-4)  # their expected ratios.mean()
    # Not used: the same file's test_policy_loss_clipped_for_low_logprobs (expects 0.8) and
    # test_policy_loss_not_clipped (expects +e^0.1) carry sign slips; they pass there only
    # because assert_close is called with rtol=1e6. Their own formula gives max(-1/e, -0.8) =
    # -1/e and -e^0.1, which is what we give:
    low, _ = policy_loss(t([[-0.5, -0.2, 0.2]]), t([[0.5, 0.8, 1.2]]), t([[1.0, 1.0, 1.0]]),
                         torch.ones(1, 3), 0.2, 0.2, None, "token_mean")
    close(low, -1 / math.e, atol=1e-6)
    inside, _ = policy_loss(t([[0.6, 0.9, 1.3]]), t([[0.5, 0.8, 1.2]]), t([[1.0, 1.0, 1.0]]),
                            torch.ones(1, 3), 0.2, 0.2, None, "token_mean")
    close(inside, -math.exp(0.1), atol=1e-6)


def test_policy_loss_asymmetric_clip():
    # No peer test read publishes a literal number with clip_low != clip_high (the NeMo-RL,
    # SkyRL and torchtune tests all use 0.2 / 0.2; verl, OpenRLHF, AReaL have no literal PPO loss
    # numbers). Two checks:
    # (1) published one-sided numbers must not depend on the other bound. torchtune's -1.2
    #     (test_policy_loss_clipped_for_high_logprobs, see above) uses only the upper bound
    #     1 + 0.2; with clip_low = 0.1 or 0.3 (lower bound 0.9 / 0.7) it must stay -1.2.
    #     NeMo-RL's -0.6333 (test_clipped_pg_loss_ppo_clipping) also uses only the upper bound:
    #     its ratio-0.5 token has A > 0, so the pessimistic max keeps -0.5 whatever the lower
    #     bound is.
    for clip_low in (0.1, 0.3):
        loss, _ = policy_loss(t([[1.5, 1.8, 2.2]]), t([[0.5, 0.8, 1.2]]), t([[1.0, 1.0, 1.0]]),
                              torch.ones(1, 3), clip_low, 0.2, None, "token_mean")
        close(loss, -1.2, atol=1e-4)
        loss, _ = policy_loss(_nemo([-1.69315, -1.0, -0.59453], 7.0), _nemo([-1.0] * 3, 0.0),
                              _nemo([1.0, -1.0, 2.0], 100.0), NEMO_MASK, clip_low, 0.2, None,
                              "token_mean")
        close(loss, -0.6333, atol=1e-4)
    # (2) by hand, DAPO's clip-higher (clip_low 0.2, clip_high 0.28 -> range [0.8, 1.28]) on
    #     NeMo-RL's inputs: per token max(-.5, -.8) = -.5; 1.0; max(-2*1.5, -2*1.28) = -2.56;
    #     mean (-0.5 + 1.0 - 2.56) / 3 = -2.06 / 3 = -0.686667.
    loss, _ = policy_loss(_nemo([-1.69315, -1.0, -0.59453], 7.0), _nemo([-1.0] * 3, 0.0),
                          _nemo([1.0, -1.0, 2.0], 100.0), NEMO_MASK, 0.2, 0.28, None, "token_mean")
    close(loss, -2.06 / 3, atol=1e-4)
    #     and the active lower bound (A < 0, ratio 0.5 below 1 - clip_low): A = -1 gives
    #     max(0.5, 0.9) = 0.9 with clip_low 0.1 and max(0.5, 0.7) = 0.7 with clip_low 0.3,
    #     whatever clip_high is.
    for clip_low, expected in ((0.1, 0.9), (0.3, 0.7)):
        for clip_high in (0.2, 0.28):
            loss, stats = policy_loss(t([[math.log(0.5)]]), t([[0.0]]), t([[-1.0]]), t([[1.0]]),
                                      clip_low, clip_high, None, "token_mean")
            close(loss, expected, atol=1e-9)
            close(stats.clip_fraction, 1.0, atol=1e-9)


DUAL_LOGPROBS = [-1.69315, -1.0, -0.69741]  # log(0.5) - 1, log(1) - 1, log(10) - 3
DUAL_OLD = [-1.0, -1.0, -3.0]
DUAL_ADV = [1.0, -1.0, -4.0]


def test_policy_loss_dual_clip_matches_nemo_rl():
    # NVIDIA-NeMo/RL tests/unit/algorithms/test_loss_functions.py::test_clipped_pg_loss_dual_clip
    # ratio_clip_c = 3, clip 0.2 / 0.2, A = [1, -1, -4], ratios [0.5, 1, 10]: PPO max =
    # [-0.5, 1.0, 40.0]; for A < 0 the cap -c*A = [3, 12] -> [-0.5, 1.0, 12.0]; token mean
    # 12.5 / 3 = 4.1667. Their rule min(max(.), -c*A) on A < 0 is our "cap where it binds".
    loss, stats = policy_loss(_nemo(DUAL_LOGPROBS, 9.0), _nemo(DUAL_OLD, 0.0),
                              _nemo(DUAL_ADV, -50.0), NEMO_MASK, 0.2, 0.2, 3.0, "token_mean")
    close(loss, 4.1667, atol=1e-4)
    close(stats.dual_clip_fraction, 1 / 3, atol=1e-9)  # (not published) only the 3rd token


def test_policy_loss_dual_clip_sum_matches_skyrl():
    # NovaSky-AI/SkyRL tests/train/algorithms/test_losses.py::test_policy_loss_dual_clip
    # (adapted there from NeMo-RL): same inputs, eps_clip_low = eps_clip_high = 0.2,
    # clip_ratio_c = 3, but reduced as a plain token SUM: 12.5 (abs 1e-4).
    # Mapping: one row, seq_mean_token_sum_norm with norm_length = 1 is that row's token sum.
    loss, _ = policy_loss(t([DUAL_LOGPROBS]), t([DUAL_OLD]), t([DUAL_ADV]), torch.ones(1, 3),
                          0.2, 0.2, 3.0, "seq_mean_token_sum_norm", norm_length=1.0)
    close(loss, 12.5, atol=1e-4)


# ------------------------------------------------------------------------------ value loss

def test_value_loss_on_torchtune_inputs():
    # No peer publishes a literal clipped value loss: torchtune
    # tests/torchtune/rlhf/loss/test_ppo_loss.py::TestPPOLoss::
    # test_value_loss_lower_for_values_similar_to_return asserts only an ordering, and NeMo-RL's
    # tests/unit/algorithms/test_ppo.py::test_mse_value_loss_* use random data (and skip without
    # a GPU). Their formula is ours: 0.5 * mean(max((v - R)^2, (clip(v, old +- 0.2) - R)^2)).
    # Their inputs: returns [1, 1, 1], old values [0.9, 1.0, 1.1], value_clip_range 0.2.
    returns = t([[1.0, 1.0, 1.0]])
    old = t([[0.9, 1.0, 1.1]])
    full = torch.ones(1, 3)
    # values = old: squares [0.01, 0, 0.01] both ways -> 0.5 * 0.02 / 3 = 0.0033333
    lower, frac_lower = value_loss(old, old, returns, full, 0.2, "token_mean")
    close(lower, 0.01 / 3, atol=1e-9)
    # values [0.5, 1.5, 2.0]: unclipped squares [0.25, 0.25, 1.0]; clip to old +- 0.2 =
    # [0.7, 1.2, 1.3] -> squares [0.09, 0.04, 0.09]; max = unclipped -> 0.5 * 1.5 / 3 = 0.25
    higher, frac_higher = value_loss(t([[0.5, 1.5, 2.0]]), old, returns, full, 0.2, "token_mean")
    close(higher, 0.25, atol=1e-9)
    assert lower < higher  # the ordering torchtune publishes
    close(frac_lower, 0.0, atol=0)
    close(frac_higher, 0.0, atol=0)


def test_value_loss_clipped_branch_by_hand():
    # No peer number (see above); derived by hand. clip_range 0.2, one padded garbage slot.
    #   token 1: v 1.5, old 1.0, R 2.0: unclipped (1.5-2)^2 = 0.25; clip(1.5, 0.8, 1.2) = 1.2,
    #            (1.2-2)^2 = 0.64 -> max 0.64 (clipped branch active)
    #   token 2: v 0.0, old 0.5, R 1.0: unclipped 1.0; clip(0, 0.3, 0.7) = 0.3, (0.3-1)^2 = 0.49
    #            -> max 1.0 (unclipped)
    # loss = 0.5 * (0.64 + 1.0) / 2 = 0.41; clip_fraction = 1/2
    loss, frac = value_loss(t([[1.5, 0.0, 9.0]]), t([[1.0, 0.5, -9.0]]), t([[2.0, 1.0, 99.0]]),
                            t([[1.0, 1.0, 0.0]]), 0.2, "token_mean")
    close(loss, 0.41, atol=1e-9)
    close(frac, 0.5, atol=1e-9)


# ------------------------------------------------------------------------------------- KL

@pytest.mark.parametrize("estimator, expected", [
    ("k1", [[-1.0, 14.0, 29.0]]),
    ("k2", [[0.5, 98.0, 420.5]]),
    ("k3", [[0.7183, 13.0, 28.0]]),
])
def test_kl_estimators_match_nemo_rl(estimator, expected):
    # NVIDIA-NeMo/RL tests/unit/algorithms/test_loss_functions.py::test_calculate_kl (un-clamped
    # part): logprobs [-1, -1, -1], reference [0, -15, -30]. Their k1 = logprobs - ref, k2 =
    # 0.5 r^2, k3 = exp(ref - logprobs) - (ref - logprobs) - 1, i.e. ours on r = logprobs - ref.
    # Published to 4 digits with rtol 1e-3; k3 at r = 14 is 13 + e^-14 (~8e-7 off 13).
    kl = kl_estimate(t([[-1.0, -1.0, -1.0]]), t([[0.0, -15.0, -30.0]]), estimator)
    close(kl, expected, atol=1e-4)


def test_k3_matches_nemo_rl_kl_penalty_terms():
    # NVIDIA-NeMo/RL tests/unit/algorithms/test_loss_functions.py::test_clipped_pg_loss_kl_penalty
    # curr [0, -1, -2], ref [-1, -1, -1]: per-token k3 [0.368, 0.0, 0.718], mean 0.362 (3 digits).
    kl = kl_estimate(t([[0.0, -1.0, -2.0]]), t([[-1.0, -1.0, -1.0]]), "k3")
    close(kl, [[0.368, 0.0, 0.718]], atol=1e-3)
    close(kl.mean(), 0.362, atol=1e-3)
    # ...::test_calculate_kl_detaches_importance_sampling_when_input_clamped: the un-clamped entry
    # (logprob -1, ref 0, IS weight 1 in value) publishes k3 = e - 2 = 0.7182818 (7 digits).
    close(kl_estimate(t([[-1.0]]), t([[0.0]]), "k3"), [[0.7182818]], atol=1e-7)


def test_k1_kl_and_reward_penalty_match_torchtune():
    # torchtune tests/torchtune/rlhf/test_rewards.py::TestGetRewards::test_get_rewards_ppo
    # kl = logprobs - ref_logprobs (our k1) and kl_rewards = -kl_coeff * kl with kl_coeff 0.5.
    # (Their total rewards also add the score on the last token: reward assembly, not tested
    # here.)
    logprobs = t([[0.1, 0.2, 0.3], [0.4, 0.5, 0.6], [0.6, 0.7, 0.8]])
    ref = t([[0.2, 0.3, 0.4], [0.6, 0.7, 0.8], [0.9, 1.0, 1.1]])
    close(kl_estimate(logprobs, ref, "k1"),
          [[-0.1, -0.1, -0.1], [-0.2, -0.2, -0.2], [-0.3, -0.3, -0.3]], atol=1e-4)
    close(kl_penalty_rewards(logprobs, ref, torch.ones(3, 3), 0.5, "k1"),
          [[0.05, 0.05, 0.05], [0.1, 0.1, 0.1], [0.15, 0.15, 0.15]], atol=1e-4)
