"""The advantage rule (ppo/advantages.py): task advantages normalised, the KL pull added after at
kl_coef, so both arms are held to the reference with the same weight; grpo's std floor.

The tests build an ORM-like and a PRM-like set of reward terms on the same rows and KL, and check:
the effective KL weight is kl_coef in both (while the task scales differ), an all-uniform batch is
moved by the KL pull alone, the KL is neither centred by the group baselines nor counted in grpo's
group statistics, GAE's critic learns the task return, and the trainer's `assemble` uses the rule.
"""

from __future__ import annotations

import pytest
import torch

from prmppo.ppo import advantages as rule
from prmppo.ppo import estimators, maths
from prmppo.ppo.loop import PPOTrainer
from prmppo.rewards.kl import kl_estimate
from prmppo.rewards.orm import OutcomeReward
from prmppo.rewards.terms import RewardTerm, RewardTerms
from trainer_builders import ppo_settings, random_rollout, tiny_trainer

# 2 prompts x 4 samples, responses of 5 or 4 tokens, right-padded
MASK = torch.tensor([[1, 1, 1, 1, 1]] * 4 + [[1, 1, 1, 1, 0]] * 4, dtype=torch.float32)  # [8, 5]
LAST = torch.zeros(8, 5, dtype=torch.bool)
LAST[:4, 4] = True
LAST[4:, 3] = True
STEP_ENDS = torch.zeros(8, 5, dtype=torch.bool)
STEP_ENDS[:, 1] = True
STEP_ENDS |= LAST


def _kl(seed: int = 0) -> torch.Tensor:
    return torch.rand(8, 5, generator=torch.Generator().manual_seed(seed)) * MASK  # [8, 5] >= 0


def _orm(outcome: list[float]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    values = torch.tensor(outcome)[:, None] * LAST  # [8, 5]
    return [(values, LAST)]


def _prm(outcome: list[float], seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    scores = torch.rand(8, 5, generator=torch.Generator().manual_seed(seed)) * STEP_ENDS  # [8, 5]
    return [*_orm(outcome), (scores, STEP_ENDS)]


def _compute(terms, kl, estimator="rloo", kl_coef=0.05, whiten=True, group_std_floor=0.0, group_same_tol=0.0, **kw):
    """`rule.compute` on the 2 x 4 batch above; grpo's floor and tolerance off unless a test sets them."""
    return rule.compute(terms, kl, MASK, MASK, estimator=estimator, group_size=4, gamma=1.0, kl_coef=kl_coef,
                        whiten=whiten, group_std_floor=group_std_floor, group_same_tol=group_same_tol, **kw)


def _effective(terms, kl, estimator="rloo", kl_coef=0.05, **kw):
    with_kl = _compute(terms, kl, estimator, kl_coef, **kw)
    without = _compute(terms, kl, estimator, 0.0, **kw)
    return rule.effective_kl_coef(with_kl.advantages, without.advantages, kl, MASK, 1.0), with_kl.task_scale


@pytest.mark.parametrize("estimator", ["rloo", "grpo"])
def test_the_effective_kl_weight_is_kl_coef_in_both_arms(estimator):
    outcome = [1., 0., 0., 1., 1., 1., 0., 1.]
    kl = _kl()
    orm, orm_scale = _effective(_orm(outcome), kl, estimator)
    prm, prm_scale = _effective(_prm(outcome), kl, estimator)
    assert abs(orm_scale - prm_scale) > 0.1  # the arms' task advantages are scaled differently ...
    assert orm == pytest.approx(0.05, abs=1e-6) and prm == pytest.approx(0.05, abs=1e-6)  # ... their KL alike


def test_the_effective_kl_weight_under_gae_is_kl_coef_in_both_arms():
    outcome = [1., 0., 0., 1., 1., 1., 0., 1.]
    values = torch.rand(8, 5, generator=torch.Generator().manual_seed(3)) * MASK
    kw = dict(values=values, bootstrap=torch.zeros(8), lam_actor=0.95, lam_critic=1.0)
    orm, _ = _effective(_orm(outcome), _kl(), "gae", **kw)
    prm, _ = _effective(_prm(outcome), _kl(), "gae", **kw)
    assert orm == pytest.approx(0.05, abs=1e-6) and prm == pytest.approx(0.05, abs=1e-6)


def test_a_kl_normalised_with_the_task_advantages_shows_in_the_measured_weight():
    # the measurement is not the configured number: whitening the sum scales the KL by 1/std
    outcome = [1., 0., 0., 1., 1., 1., 0., 1.]
    kl = _kl()
    terms = _orm(outcome)
    summed = (estimators.group_baseline_advantages(terms, MASK, 4, 1.0, "rloo")
              + estimators.returns_to_go(-0.05 * kl, MASK, 1.0))
    no_kl = estimators.group_baseline_advantages(terms, MASK, 4, 1.0, "rloo")
    measured = rule.effective_kl_coef(maths.masked_rescale(summed, MASK), maths.masked_rescale(no_kl, MASK), kl,
                                      MASK, 1.0)
    assert measured > 0.05 * 1.5


@pytest.mark.parametrize("estimator", ["rloo", "grpo"])
@pytest.mark.parametrize("arm", ["orm", "prm"])
def test_an_all_uniform_batch_moves_by_the_kl_pull_alone(estimator, arm):
    outcome = [1., 1., 1., 1., 0., 0., 0., 0.]  # both groups uniform
    if arm == "orm":
        terms = _orm(outcome)
    else:  # identical samples score identical steps: flat within the group
        terms = [*_orm(outcome), (torch.tensor([0.9, 0.9, 0.9, 0.9, 0.2, 0.2, 0.2, 0.2])[:, None] * STEP_ENDS,
                                  STEP_ENDS)]
    kl = _kl()
    out = _compute(terms, kl, estimator)
    # the KL return-to-go at weight 0.05, not scaled (the old rule multiplied the ORM arm's by x379 here)
    expected = estimators.returns_to_go(-0.05 * kl, MASK, 1.0)
    assert torch.allclose(out.advantages, expected, atol=1e-7)


def test_the_kl_is_not_centred_by_the_group_baseline():
    # one group whose samples differ only in their KL: each token's advantage is its own KL return-to-go,
    # not that minus the group's mean (which would reward some samples for the others' KL)
    outcome = [1., 1., 1., 1., 1., 1., 1., 1.]
    kl = torch.zeros(8, 5)
    kl[0] = 1.0 * MASK[0]  # only sample 0 moved away from the reference
    out = _compute(_orm(outcome), kl, "rloo", kl_coef=0.1, whiten=False)
    assert torch.allclose(out.advantages[0], torch.tensor([-0.5, -0.4, -0.3, -0.2, -0.1]))
    assert torch.equal(out.advantages[1:4], torch.zeros(3, 5))


def test_the_kl_stays_out_of_grpo_statistics():
    # outcome 1 of 4 right: grpo's group mean 0.25 and unbiased std 0.5 come from the outcomes alone,
    # whatever the KL; so the right sample's outcome advantage is (1 - 0.25) / 0.5 = 1.5 at every token
    outcome = [1., 0., 0., 0., 1., 1., 1., 1.]
    kl = _kl()
    out = _compute(_orm(outcome), kl, "grpo", kl_coef=0.2, whiten=False)
    task = out.advantages - estimators.returns_to_go(-0.2 * kl, MASK, 1.0)
    assert torch.allclose(task[0], torch.full((5,), 1.5), atol=1e-5)
    assert torch.allclose(task[1], torch.full((5,), -0.5), atol=1e-5)
    assert torch.allclose(task[4:], torch.zeros(4, 5), atol=1e-6)


def test_gae_critic_learns_the_task_return_and_the_kl_pull_joins_after_whitening():
    # gamma 1, lam 1, zero values: task advantage = return-to-go of the outcome; returns = the same
    outcome = [1., 0., 0., 1., 1., 1., 0., 1.]
    kl = _kl()
    values = torch.zeros(8, 5)
    out = _compute(_orm(outcome), kl, "gae", kl_coef=0.3, values=values, bootstrap=torch.zeros(8))
    task = torch.tensor(outcome)[:, None] * MASK  # [8, 5]
    assert torch.allclose(out.returns, task)  # no KL in the critic's targets
    expected = maths.masked_whiten(task, MASK) + estimators.returns_to_go(-0.3 * kl, MASK, 1.0)
    assert torch.allclose(out.advantages, expected * MASK, atol=1e-6)


def test_the_update_mask_sets_the_normalisation_and_zeroes_the_dropped_rows():
    outcome = [1., 1., 1., 1., 1., 0., 0., 1.]
    update = MASK.clone()
    update[:4] = 0  # the uniform group is dropped
    out = rule.compute(_prm(outcome), _kl(), MASK, update, estimator="rloo", group_size=4, gamma=1.0,
                       kl_coef=0.05, whiten=True, group_std_floor=0.0, group_same_tol=0.0)
    assert torch.equal(out.advantages[:4], torch.zeros(4, 5))
    task = out.advantages - estimators.returns_to_go(-0.05 * _kl(), MASK, 1.0) * update
    assert float(maths.masked_var(task, update)) == pytest.approx(1.0, abs=1e-5)


# ----------------------------------------------------------------------------- grpo's std floor

def test_grpo_std_floor_keeps_jitter_small_and_leaves_outcome_groups_alone():
    # identical samples whose step scores differ by 1e-4 (numerical jitter): without the floor, each
    # step's deviation is divided by a std of ~5e-5 and becomes as large as a real contrast
    jitter = torch.tensor([0.0, 1e-4, -1e-4, 0.0, 0.0, 1e-4, -1e-4, 0.0])
    steps = (0.8 + jitter)[:, None] * STEP_ENDS
    bare = estimators.group_baseline_advantages([(steps, STEP_ENDS)], MASK, 4, 1.0, "grpo")
    floored = estimators.group_baseline_advantages([(steps, STEP_ENDS)], MASK, 4, 1.0, "grpo", std_floor=0.1)
    assert bare.abs().max() > 0.5
    assert floored.abs().max() < 1e-4 * 2 / 0.1 + 1e-6
    # a 0/1 outcome group with both kinds of sample has std >= 1/sqrt(4): the floor changes nothing
    outcome = _orm([1., 0., 0., 0., 1., 1., 0., 0.])
    assert torch.equal(estimators.group_baseline_advantages(outcome, MASK, 4, 1.0, "grpo", std_floor=0.1),
                       estimators.group_baseline_advantages(outcome, MASK, 4, 1.0, "grpo"))


def test_grpo_std_floor_refuses_a_negative_value():
    with pytest.raises(ValueError, match="std_floor=-0.1"):
        estimators.group_baseline_advantages(_orm([1.] * 8), MASK, 4, 1.0, "grpo", std_floor=-0.1)


def test_the_trainer_passes_the_std_floor_to_grpo():
    steps = (0.8 + torch.tensor([0.0, 1e-4, -1e-4, 0.0, 0.0, 1e-4, -1e-4, 0.0]))[:, None]
    trainer = _trainer(_ppo("ppo.advantage_estimator=grpo", "ppo.kl_coef=0", "ppo.whiten_advantages=false"))
    batch = _rollout([1.] * 8)
    ends = batch.response_mask.bool()
    rewards = RewardTerms({"process": RewardTerm(steps * ends, ends)})
    train, _ = trainer.assemble(batch, rewards, trainer.plan(batch, 0))
    assert train.advantages.abs().max() < 1e-4 * 2 / 0.1 * ends.sum(-1).max() + 1e-6


# ----------------------------------------------------------------------------- the trainer uses the rule

def _ppo(*overrides: str):
    # two optimizer steps of 4 rows: assemble computes the whole rule itself (one step of all 8 rows would leave
    # the KL pull to the update: tests/ppo/test_old_from_update.py)
    return ppo_settings("ppo.minibatch_rows=4", *overrides)


def _trainer(ppo) -> PPOTrainer:
    return tiny_trainer(ppo, lora_b_scale=0.5)  # the policy off the reference, so the KL is not 0


_rollout = random_rollout


def _process_reward(batch) -> RewardTerms:
    """The outcome plus a step score at every token (a PRM-like second term)."""
    terms = OutcomeReward()(batch)[0].terms
    scores = 3 * torch.rand(batch.response_mask.shape, generator=torch.Generator().manual_seed(2)) * batch.response_mask
    return RewardTerms({**terms, "process": RewardTerm(scores, batch.response_mask.bool())})


@pytest.mark.parametrize("estimator", ["rloo", "grpo", "gae"])
def test_assemble_logs_the_same_effective_kl_weight_under_both_arms(estimator):
    trainer = _trainer(_ppo(f"ppo.advantage_estimator={estimator}", "ppo.kl_coef=0.05"))
    batch = _rollout([1., 0., 0., 1., 1., 1., 0., 1.])
    _, orm = trainer.assemble(batch, OutcomeReward()(batch)[0], trainer.plan(batch, 0))
    trainer = _trainer(_ppo(f"ppo.advantage_estimator={estimator}", "ppo.kl_coef=0.05"))
    _, prm = trainer.assemble(batch, _process_reward(batch), trainer.plan(batch, 0))
    assert abs(orm["ppo/kl_ref"]) > 1e-3  # the policy is off the reference (k1 is signed)
    assert orm["adv/task_scale"] != pytest.approx(prm["adv/task_scale"], rel=0.2)  # the arms' scales differ
    assert orm["kl/effective_coef"] == pytest.approx(0.05, abs=1e-5)
    assert prm["kl/effective_coef"] == pytest.approx(0.05, abs=1e-5)


@pytest.mark.parametrize("estimator", ["rloo", "grpo"])
def test_assemble_on_an_all_uniform_batch_gives_the_kl_pull_alone(estimator):
    trainer = _trainer(_ppo(f"ppo.advantage_estimator={estimator}", "ppo.kl_coef=0.05"))
    batch = _rollout([1., 1., 1., 1., 0., 0., 0., 0.])
    train, metrics = trainer.assemble(batch, OutcomeReward()(batch)[0], trainer.plan(batch, 0))
    kl = kl_estimate(train.old_logprobs, train.ref_logprobs, "k1") * train.response_mask
    expected = estimators.returns_to_go(-0.05 * kl, train.response_mask, 1.0)
    assert float(kl.abs().sum()) > 0.1
    assert torch.allclose(train.advantages, expected, atol=1e-6)


def test_normalisation_does_not_magnify_jitter_of_an_all_uniform_batch_to_unit_size():
    # every group uniform in outcome, identical samples whose step scores differ by 1e-4: the task
    # advantages are jitter; dividing by their own std (~1e-4) would make them as large as a real contrast
    jitter = torch.tensor([0.0, 1e-4, -1e-4, 0.0, 0.0, 1e-4, -1e-4, 0.0])
    terms = [*_orm([1.] * 8), ((0.8 + jitter)[:, None] * STEP_ENDS, STEP_ENDS)]
    out = _compute(terms, _kl(), "rloo", kl_coef=0.0)
    assert 0 < out.advantages.abs().max() < 0.05
    assert out.task_scale == pytest.approx(1 / rule.MIN_TASK_STD)


def test_identical_group_share_counts_token_identical_groups_and_their_mass():
    ids = torch.tensor([[5, 6, 7, 0], [5, 6, 7, 0], [5, 6, 7, 0], [5, 6, 7, 0],   # group 0: identical
                        [5, 6, 7, 0], [5, 6, 8, 0], [5, 6, 7, 0], [5, 6, 7, 0]])  # group 1: one differs
    mask = torch.tensor([[1, 1, 1, 0]] * 8, dtype=torch.float32)
    adv = torch.zeros(8, 4)
    adv[0, :3] = 0.1  # 0.3 of mass in the identical group
    adv[5, :3] = -0.9  # 2.7 in the other
    adv[1, 3] = 50.0  # padding carries nothing
    share = rule.identical_group_share(adv, ids, mask, 4)
    assert share == {"adv/identical_group_fraction": 0.5, "adv/identical_group_mass": pytest.approx(0.1)}
    # a padding token that differs does not make samples different; a longer response does
    ids[1, 3] = 9
    assert rule.identical_groups(ids, mask, 4).tolist() == [True, False]
    mask[2, 3] = 1
    assert rule.identical_groups(ids, mask, 4).tolist() == [False, False]


def test_the_first_gae_update_clips_its_value_loss_around_what_the_head_predicts():
    # the head starts at zero; the first batch sets its return statistics, so it now predicts the mean
    # return. Old values kept at the initial 0 put the clip range around 0, far from every prediction
    # of the first minibatch, and clipped most of the first value loss.
    trainer = _trainer(_ppo("ppo.advantage_estimator=gae", "ppo.kl_coef=0", "ppo.value_clip=0.2"))
    batch = _rollout([1., 0., 0., 1., 1., 1., 0., 1.])
    rewards = RewardTerms({"outcome": RewardTerm(3.0 * batch.outcome[:, None] * batch.response_mask,
                                                 batch.response_mask.bool())})  # returns well away from 0
    train, _ = trainer.assemble(batch, rewards, trainer.plan(batch, 0))
    head = trainer.policy.value_head
    assert float(head.return_mean) > 1.0
    assert torch.allclose(train.old_values, head.return_mean * train.response_mask.bool(), atol=1e-5)
    metrics = trainer.update(train, iteration=0)
    assert metrics["value/clip_fraction"] == 0.0


def test_grpo_gives_identical_samples_no_advantage_from_their_step_profile():
    # identical samples whose steps score 0.9 then 0.99 (a profile, not a contrast), with jitter 1e-3:
    # the std pooled over the group's events is ~0.05, under the floor, so the floor alone leaves
    # advantages of (0.9 - 0.945) / 0.1 ~ -0.45 between the steps; same_tol makes the group uniform
    profile = torch.zeros(8, 5)
    profile[:, 1], profile[:4, 4], profile[4:, 3] = 0.9, 0.99, 0.99
    profile += torch.tensor([0.0, 1e-3, -1e-3, 0.0, 0.0, 1e-3, 0.0, -1e-3])[:, None] * STEP_ENDS
    terms = [(profile * STEP_ENDS, STEP_ENDS)]
    floored = estimators.group_baseline_advantages(terms, MASK, 4, 1.0, "grpo", std_floor=0.1)
    same = estimators.group_baseline_advantages(terms, MASK, 4, 1.0, "grpo", std_floor=0.1, same_tol=0.01)
    assert floored.abs().max() > 0.3
    assert torch.equal(same, torch.zeros(8, 5))
    # a real contrast in one group stays: sample 4's second step scores 0.5
    profile[4, 3] = 0.5
    kept = estimators.group_baseline_advantages([(profile * STEP_ENDS, STEP_ENDS)], MASK, 4, 1.0, "grpo", std_floor=0.1,
                                           same_tol=0.01)
    assert torch.equal(kept[:4], torch.zeros(4, 5)) and kept[4:].abs().max() > 0.5
    with pytest.raises(ValueError, match="same_tol=-1"):
        estimators.group_baseline_advantages(terms, MASK, 4, 1.0, "grpo", same_tol=-1)


def test_the_trainer_passes_the_same_tolerance_to_grpo():
    # every row pays one step score at its first token, 0.7 up to jitter of 1e-3: no contrast anywhere
    batch = _rollout([1.] * 8)
    ends = torch.zeros_like(batch.response_mask, dtype=torch.bool)
    ends[:, 0] = True
    steps = (0.7 + torch.tensor([0.0, 1e-3, -1e-3, 0.0, 0.0, 1e-3, 0.0, -1e-3]))[:, None] * ends
    rewards = RewardTerms({"process": RewardTerm(steps, ends)})
    overrides = ("ppo.advantage_estimator=grpo", "ppo.kl_coef=0", "ppo.whiten_advantages=false",
                 "ppo.group_std_floor=0")
    train, _ = _trainer(_ppo(*overrides)).assemble(batch, rewards, _trainer(_ppo(*overrides)).plan(batch, 0))
    assert torch.equal(train.advantages, torch.zeros_like(train.advantages))
    off = _trainer(_ppo(*overrides, "ppo.group_same_tol=0"))
    train, _ = off.assemble(batch, rewards, off.plan(batch, 0))
    assert train.advantages.abs().max() > 0.5  # without it, jitter / its own std is a full-size advantage


@pytest.mark.parametrize("estimator", ["grpo", "gae"])
def test_the_task_part_is_the_advantages_at_kl_coef_zero(estimator):
    values = {"values": torch.rand(8, 5, generator=torch.Generator().manual_seed(3)) * MASK} if estimator == "gae" else {}
    for terms in (_orm([1., 0., 0., 1., 0., 0., 0., 1.]), _prm([1., 0., 0., 1., 0., 0., 0., 1.])):
        out = _compute(terms, _kl(), estimator, kl_coef=0.05, **values)
        assert torch.equal(out.task, _compute(terms, _kl(), estimator, kl_coef=0.0, **values).advantages)
        assert torch.equal(out.advantages, out.task + out.kl_pull)


@pytest.mark.parametrize("arm", ["orm", "prm"])
def test_assemble_takes_each_return_to_go_once(arm, monkeypatch):
    # one per reward term, one for the KL pull, one for the effective-coefficient fit: the task advantages are
    # not computed a second time at kl_coef 0 (on a GPU each of these is a loop of T steps the host launches)
    trainer = _trainer(_ppo("ppo.advantage_estimator=grpo", "ppo.kl_coef=0.05"))
    batch = _rollout([1., 0., 0., 1., 0., 0., 0., 1.])
    reward = OutcomeReward()(batch)[0] if arm == "orm" else _process_reward(batch)
    calls = []
    real = estimators.gae
    monkeypatch.setattr(estimators, "gae", lambda *a, **k: calls.append(1) or real(*a, **k))
    _, metrics = trainer.assemble(batch, reward, trainer.plan(batch, 0))
    assert len(calls) == len(reward.terms) + 2
    assert metrics["kl/effective_coef"] == pytest.approx(0.05, abs=1e-5)
