"""Hand-worked checks of prmppo.ppo.maths; the arithmetic is written beside each assert."""

from __future__ import annotations

import math

import pytest
import torch

from prmppo.ppo.maths import (
    AGG_MODES,
    aggregate,
    decoupled_gae,
    entropy_from_logits,
    explained_variance,
    gae,
    group_baseline_advantages,
    returns_to_go,
    logprobs_from_logits,
    make_scheduler,
    masked_mean,
    masked_sum,
    masked_whiten,
    policy_loss,
    value_loss,
    warmup_cosine,
)

NAN = float("nan")


def t(rows):
    return torch.tensor(rows, dtype=torch.float64)


def close(actual, expected, atol=1e-6):
    torch.testing.assert_close(torch.as_tensor(actual, dtype=torch.float64),
                               torch.as_tensor(expected, dtype=torch.float64),
                               atol=atol, rtol=0)


# ----------------------------------------------------------------------------------- GAE

REWARDS = t([[1.0, 0.0, 2.0]])
VALUES = t([[0.5, 1.0, 1.5]])
FULL = t([[1.0, 1.0, 1.0]])


def test_gae_gamma1_lam1_is_reward_to_go_minus_values():
    adv, ret = gae(REWARDS, VALUES, FULL, gamma=1.0, lam=1.0)
    # reward-to-go: [1+0+2, 0+2, 2] = [3, 2, 2]; minus V [0.5, 1, 1.5] -> [2.5, 1.0, 0.5]
    close(adv, [[2.5, 1.0, 0.5]])
    close(ret, [[3.0, 2.0, 2.0]])


def test_gae_gamma09_lam05_by_hand():
    adv, ret = gae(REWARDS, VALUES, FULL, gamma=0.9, lam=0.5)
    # deltas (V = 0 after the last token):
    #   d2 = 2 + 0          - 1.5 = 0.5
    #   d1 = 0 + 0.9 * 1.5  - 1.0 = 0.35
    #   d0 = 1 + 0.9 * 1.0  - 0.5 = 1.4
    # gamma * lam = 0.45:
    #   A2 = 0.5; A1 = 0.35 + 0.45 * 0.5 = 0.575; A0 = 1.4 + 0.45 * 0.575 = 1.65875
    close(adv, [[1.65875, 0.575, 0.5]])
    # returns = A + V = [2.15875, 1.575, 2.0]
    close(ret, [[2.15875, 1.575, 2.0]])


def test_gae_padding_is_zero_and_rows_are_independent():
    rewards = t([[1.0, 0.0, 2.0], [0.0, 1.0, 99.0]])
    values = t([[0.5, 1.0, 1.5], [0.2, 0.4, NAN]])  # garbage on the padded position
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]], dtype=torch.bool)
    adv, ret = gae(rewards, values, mask, gamma=0.9, lam=0.5)
    # row 2 ends at t=1, so V after it is 0 (not 0.9 * garbage):
    #   d1 = 1 - 0.4 = 0.6;  d0 = 0 + 0.9 * 0.4 - 0.2 = 0.16
    #   A1 = 0.6;  A0 = 0.16 + 0.45 * 0.6 = 0.43;  returns = [0.63, 1.0]
    close(adv[1], [0.43, 0.6, 0.0])
    close(ret[1], [0.63, 1.0, 0.0])
    close(adv[0], [1.65875, 0.575, 0.5])  # row 1 unchanged by row 2
    adv_alone, ret_alone = gae(rewards[1:, :2], values[1:, :2], mask[1:, :2].float(), 0.9, 0.5)
    close(adv[1:, :2], adv_alone)
    close(ret[1:, :2], ret_alone)


def test_decoupled_gae_critic_lambda_one_gives_monte_carlo_returns():
    adv, targets = decoupled_gae(REWARDS, VALUES, FULL, gamma=0.9, lam_actor=0.5, lam_critic=1.0)
    # lam_critic = 1: discounted reward-to-go, independent of V:
    #   G2 = 2; G1 = 0 + 0.9 * 2 = 1.8; G0 = 1 + 0.9 * 1.8 = 2.62
    close(targets, [[2.62, 1.8, 2.0]])
    # the advantages are the lam = 0.5 ones worked above, not the lam = 1 ones
    close(adv, [[1.65875, 0.575, 0.5]])
    adv1, _ = decoupled_gae(REWARDS, VALUES, FULL, gamma=1.0, lam_actor=0.5, lam_critic=1.0)
    # gamma = 1, lam = 0.5: d = [1 + 1 - 0.5, 0 + 1.5 - 1, 2 - 1.5] = [1.5, 0.5, 0.5]
    #   A2 = 0.5; A1 = 0.5 + 0.5 * 0.5 = 0.75; A0 = 1.5 + 0.5 * 0.75 = 1.875
    close(adv1, [[1.875, 0.75, 0.5]])


def test_gae_refuses_bad_arguments():
    with pytest.raises(ValueError, match="lam=1.5"):
        gae(REWARDS, VALUES, FULL, gamma=1.0, lam=1.5)
    with pytest.raises(ValueError, match="one shape"):
        gae(REWARDS, VALUES[:, :2], FULL, gamma=1.0, lam=1.0)


def _outcome_term(rewards, mask):
    """An outcome-style term: every row pays at its last real token."""
    last = torch.zeros_like(mask, dtype=torch.bool)
    last[torch.arange(mask.shape[0]), mask.sum(-1).long() - 1] = True
    return rewards, last


def test_rloo_outcome_reward_by_hand():
    # two prompts x 3 samples, reward on the last real token; row 2 has one padded position
    rewards = t([[0, 0, 1.0], [0, 0, 0], [0, 1.0, 0],
                 [0, 0, 1.0], [0, 0, 1.0], [0, 0, 1.0]])
    mask = t([[1, 1, 1], [1, 1, 1], [1, 1, 0], [1, 1, 1], [1, 1, 1], [1, 1, 1]])
    adv = group_baseline_advantages([_outcome_term(rewards, mask)], mask, group_size=3, gamma=1.0, mode="rloo")
    # group 1 returns R = (1, 0, 1): baselines (0+1)/2 = .5, (1+1)/2 = 1, (1+0)/2 = .5
    assert torch.allclose(adv[0], t([0.5, 0.5, 0.5]))
    assert torch.allclose(adv[1], t([-1.0, -1.0, -1.0]))
    assert torch.allclose(adv[2], t([0.5, 0.5, 0.0]))  # padding stays 0
    # group 2 always solved: no gradient signal at all
    assert torch.equal(adv[3:], torch.zeros(3, 3))


def test_rloo_step_rewards_are_compared_step_with_step():
    # one term with events at t=0 and t=2 in both rows; gamma = .5
    # row 0 steps (.2, .5): mean .35; row 1 steps (0, 1): mean .5
    rewards = t([[0.2, 0, 0.5], [0, 0, 1.0]])
    events = torch.tensor([[True, False, True], [True, False, True]])
    adv = group_baseline_advantages([(rewards, events)], torch.ones(2, 3), group_size=2, gamma=0.5, mode="rloo")
    # row 0 baseline = .5 (row 1's mean step reward): centred (-.3, 0, 0); G = (-.3 + .25 * 0, 0, 0)
    # row 1 baseline = .35: centred (-.35, 0, .65); G = (-.35 + .25 * .65, .5 * .65, .65)
    assert torch.allclose(adv[0], t([-0.3, 0.0, 0.0]))
    assert torch.allclose(adv[1], t([-0.1875, 0.325, 0.65]))


def test_grpo_normalises_by_group_std():
    rewards = t([[1.0], [0.0], [0.0], [1.0]])
    adv = group_baseline_advantages([_outcome_term(rewards, torch.ones(4, 1))], torch.ones(4, 1), group_size=4,
                                    gamma=1.0, mode="grpo")
    # mean .5, unbiased std sqrt(4 * .25 / 3) = .57735
    assert torch.allclose(adv[:, 0], t([0.8660, -0.8660, -0.8660, 0.8660]), atol=1e-4)


def test_grpo_process_supervision_by_hand():
    # DeepSeekMath process GRPO: every step reward of the group pooled: (1, 0) and (1, 1)
    # mean .75, unbiased std sqrt((3 * .0625 + .5625) / 3) = .5; normalised (.5, -1.5), (.5, .5)
    rewards = t([[1.0, 0.0], [1.0, 1.0]])
    events = torch.ones(2, 2, dtype=torch.bool)
    adv = group_baseline_advantages([(rewards, events)], torch.ones(2, 2), group_size=2, gamma=1.0, mode="grpo")
    # advantage = sum of the normalised rewards of this and the following steps
    assert torch.allclose(adv, t([[-1.0, -1.5], [1.0, 0.5]]), atol=1e-5)


PERFECT = t([[0, 0.99, 0, 0.99, 0, 0.99]])  # 3 steps, PRM ~.99 at each step end (t = 1, 3, 5)
STEP_ENDS = torch.tensor([[False, True, False, True, False, True]])


@pytest.mark.parametrize("mode", ["rloo", "grpo"])
def test_identical_responses_get_zero_advantage_at_every_token(mode):
    # 4 identical perfect responses: PRM term (.99 at 3 step ends) + outcome 1 on the last token.
    # A whole-response baseline against the return-to-go gave step means [0, -.99, -1.98] (rloo)
    # and [0, -197, -395] (grpo): position, not quality.
    mask = torch.ones(4, 6, dtype=PERFECT.dtype)
    process = (PERFECT.repeat(4, 1), STEP_ENDS.repeat(4, 1))
    outcome = _outcome_term(t([[0, 0, 0, 0, 0, 1.0]]).repeat(4, 1), mask)
    adv = group_baseline_advantages([process, outcome], mask, group_size=4, gamma=1.0, mode=mode)
    assert torch.allclose(adv, torch.zeros_like(adv), atol=1e-9)  # zero up to the rounding of a mean


def _two_right_two_wrong():
    """One prompt, 4 responses of 3 steps (3 tokens each); rows 2, 3 go wrong at step 2."""
    step = torch.tensor([False, False, True])
    ends = torch.cat([step, step, step]).repeat(4, 1)  # [4, 9] step ends at t = 2, 5, 8
    scores = t([[1, 1, 1], [1, 1, 1], [1, 0, 0], [1, 0, 0]])  # PRM step scores (an exact PRM)
    process = torch.zeros(4, 9, dtype=scores.dtype)
    process[ends] = scores.flatten()
    outcome = torch.zeros(4, 9, dtype=scores.dtype)
    outcome[:, -1] = t([1, 1, 0, 0])
    return process, ends, outcome, torch.ones(4, 9, dtype=scores.dtype)


@pytest.mark.parametrize("mode", ["rloo", "grpo"])
def test_right_responses_beat_wrong_ones_after_the_wrong_step(mode):
    process, ends, outcome, mask = _two_right_two_wrong()
    adv = group_baseline_advantages([(process, ends), _outcome_term(outcome, mask)], mask, group_size=4,
                                    gamma=1.0, mode=mode)
    after = slice(3, 9)  # the tokens of steps 2 and 3
    assert (adv[:2, after].min(0).values > adv[2:, after].max(0).values).all()
    # every token of a right response has a positive advantage (its last quarter included)
    assert (adv[:2] > 0).all()


def test_right_responses_beat_wrong_ones_under_gae_with_a_fitted_critic():
    # The critic is the least-squares fit of a value that sees only the position: the group's mean
    # return-to-go at each token (it cannot tell the rows apart, as a critic that has not learned the
    # task cannot); lam = 1 makes A_t = G_t - V_t.
    process, _, outcome, mask = _two_right_two_wrong()
    rewards = process + outcome
    values = returns_to_go(rewards, mask, 1.0).mean(0, keepdim=True).repeat(4, 1)
    adv, _ = gae(rewards, values, mask, gamma=1.0, lam=1.0)
    assert (adv[:2, 3:].min(0).values > adv[2:, 3:].max(0).values).all()
    assert (adv[:2] > 0).all()


def test_gae_bootstraps_a_row_cut_at_the_length_limit():
    # row 0 ended at EOS (terminal), row 1 was cut: the value after its last token is 2.0
    rewards, values = t([[0, 1.0], [0, 1.0]]), t([[0.5, 0.5], [0.5, 0.5]])
    adv, ret = gae(rewards, values, torch.ones(2, 2), gamma=1.0, lam=1.0, bootstrap=t([0.0, 2.0]))
    # row 0: G = (1, 1) -> A = (.5, .5); row 1: G = (3, 3) -> A = (2.5, 2.5)
    assert torch.allclose(adv, t([[0.5, 0.5], [2.5, 2.5]]))
    assert torch.allclose(ret, t([[1.0, 1.0], [3.0, 3.0]]))


def test_group_baseline_refuses_bad_shapes():
    term = [(torch.zeros(5, 2), torch.ones(5, 2, dtype=torch.bool))]
    with pytest.raises(ValueError, match="whole number of groups"):
        group_baseline_advantages(term, torch.ones(5, 2), group_size=2, gamma=1.0, mode="rloo")
    term = [(torch.zeros(4, 2), torch.ones(4, 2, dtype=torch.bool))]
    with pytest.raises(ValueError, match="at least 2"):
        group_baseline_advantages(term, torch.ones(4, 2), group_size=1, gamma=1.0, mode="rloo")
    with pytest.raises(ValueError, match="valid modes"):
        group_baseline_advantages(term, torch.ones(4, 2), group_size=2, gamma=1.0, mode="ppo")


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


# ---------------------------------------------------------------------------------- logits

def test_entropy_of_uniform_logits_is_log_vocab():
    close(entropy_from_logits(torch.zeros(2, 3, 7, dtype=torch.float64)),
          torch.full((2, 3), math.log(7)))


def test_entropy_with_masked_vocab_and_against_definition():
    logits = t([[[0.0, 0.0, 0.0, float("-inf")]]]).requires_grad_()
    entropy = entropy_from_logits(logits)
    close(entropy, [[math.log(3)]])  # uniform over the 3 finite entries
    entropy.sum().backward()
    assert torch.isfinite(logits.grad).all()
    torch.manual_seed(2)
    raw = torch.randn(2, 3, 5, dtype=torch.float64) * 4 + 1000  # large offset: must be stable
    p = torch.softmax(raw, -1)
    close(entropy_from_logits(raw), -(p * torch.log(p)).sum(-1), atol=1e-9)


def test_logprobs_from_logits_matches_log_softmax_gather():
    torch.manual_seed(3)
    logits = torch.randn(2, 4, 6, dtype=torch.float64) + 500.0
    tokens = torch.randint(0, 6, (2, 4))
    expected = torch.empty(2, 4, dtype=torch.float64)
    for b in range(2):
        for i in range(4):
            expected[b, i] = torch.log_softmax(logits[b, i], -1)[tokens[b, i]]
    close(logprobs_from_logits(logits, tokens), expected, atol=1e-9)
    # 2 logits [0, ln 3]: p(token 1) = 3 / 4
    close(logprobs_from_logits(t([[[0.0, math.log(3)]]]), torch.tensor([[1]])), [[math.log(0.75)]])
    with pytest.raises(ValueError, match="tokens shape"):
        logprobs_from_logits(logits, tokens[:, :3])


def test_logprobs_from_logits_upcasts_bf16():
    out = logprobs_from_logits(torch.zeros(1, 2, 4, dtype=torch.bfloat16), torch.tensor([[0, 3]]))
    assert out.dtype == torch.float32
    close(out, [[math.log(0.25)] * 2])


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


def test_warmup_cosine_by_hand():
    # total 11, warmup 4, min 0.1: warmup (s+1)/4, cosine over steps 4..10 (6 intervals)
    assert warmup_cosine(0, 11, 4, 0.1) == pytest.approx(0.25)  # 1/4
    assert warmup_cosine(3, 11, 4, 0.1) == pytest.approx(1.0)  # 4/4
    assert warmup_cosine(4, 11, 4, 0.1) == pytest.approx(1.0)  # cos(0) -> 1
    # step 7: progress 3/6 = 0.5 -> 0.1 + 0.9 * 0.5 * (1 + cos(pi/2)) = 0.55
    assert warmup_cosine(7, 11, 4, 0.1) == pytest.approx(0.55)
    assert warmup_cosine(10, 11, 4, 0.1) == pytest.approx(0.1)  # progress 1 -> min_ratio
    assert warmup_cosine(11, 11, 4, 0.1) == pytest.approx(0.1)  # past the end
    assert warmup_cosine(3, 4, 4, 0.1) == pytest.approx(1.0)  # total == warmup: no cosine
    assert warmup_cosine(0, 5, 0, 0.0) == pytest.approx(1.0)  # no warmup starts at 1


@pytest.mark.parametrize("args, name", [
    ((0, 0, 0, 0.1), "total_steps=0"),
    ((0, 10, 11, 0.1), "warmup_steps=11"),
    ((0, 10, 2, 1.5), "min_ratio=1.5"),
    ((-1, 10, 2, 0.1), "step=-1"),
])
def test_warmup_cosine_refuses_bad_arguments(args, name):
    with pytest.raises(ValueError, match=name):
        warmup_cosine(*args)


def test_make_scheduler_follows_warmup_cosine():
    param = torch.nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.SGD([param], lr=2.0)
    scheduler = make_scheduler(optimizer, total_steps=11, warmup_steps=4, min_ratio=0.1)
    lrs = []
    for _ in range(11):
        lrs.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    assert lrs[0] == pytest.approx(0.5)  # 2 * 1/4
    assert lrs[7] == pytest.approx(1.1)  # 2 * 0.55
    assert lrs[10] == pytest.approx(0.2)  # 2 * 0.1
    with pytest.raises(ValueError, match="warmup_steps=20"):
        make_scheduler(optimizer, total_steps=10, warmup_steps=20, min_ratio=0.1)
