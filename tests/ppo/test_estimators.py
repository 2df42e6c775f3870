"""Hand-worked checks of prmppo.ppo.estimators (GAE, the group baselines); the arithmetic is written beside each assert."""

from __future__ import annotations

import pytest
import torch

from prmppo.ppo.estimators import decoupled_gae, gae, group_baseline_advantages, returns_to_go

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
