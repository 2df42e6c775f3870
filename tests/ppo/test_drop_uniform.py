"""`ppo.drop_uniform_groups`: the groups whose samples the verifier scored all right or all wrong are
masked out of the update (loss and denominators), decided from the outcome for both arms; an
iteration with every group dropped updates nothing and keeps the LR schedule on its horizon."""

from __future__ import annotations

import pytest
import torch

from conftest import compose_config
from prmppo.validate import ConfigError, validate_config
from prmppo.ppo import maths
from prmppo.rewards.orm import OutcomeReward
from prmppo.rewards.terms import RewardTerm, RewardTerms
from trainer_builders import ppo_settings, random_rollout, tiny_trainer


def test_uniform_groups_are_the_all_right_and_the_all_wrong_ones():
    outcome = torch.tensor([1., 1., 1., 0., 0., 0., 1., 0., 1., 0., 1., 0., 1., 1., 1.])  # 5 groups of 3
    assert maths.uniform_groups(outcome, 3).tolist() == [True, True, False, False, True]
    assert maths.uniform_groups(outcome, 5).tolist() == [False, False, False]
    with pytest.raises(ValueError, match="whole groups of 4"):
        maths.uniform_groups(outcome, 4)


def _ppo(*overrides: str):
    return ppo_settings("ppo.drop_uniform_groups=true", *overrides)


_trainer, _rollout = tiny_trainer, random_rollout


class _StepNoise:
    """A process-like reward: a different score at every token of every row, whatever the outcome."""

    def __call__(self, batch):
        g = torch.Generator().manual_seed(2)
        values = torch.rand(batch.response_mask.shape, generator=g) * batch.response_mask
        return RewardTerms({"process": RewardTerm(values, batch.response_mask.bool())}), {}


@pytest.mark.parametrize("reward", [OutcomeReward(), _StepNoise()], ids=["orm", "step_rewards"])
def test_assemble_masks_out_exactly_the_uniform_groups(reward):
    trainer = _trainer(_ppo())
    batch = _rollout([1., 1., 1., 1., 1., 0., 0., 1.])  # group 0 all right, group 1 mixed
    rewards, _ = reward(batch)
    train, metrics = trainer.assemble(batch, rewards, trainer.plan(batch, 0))
    assert train.response_mask[:4].sum() == 0  # group 0's rows carry no token
    assert torch.equal(train.response_mask[4:], batch.response_mask[4:])
    assert metrics["ppo/dropped_groups"] == 1 and metrics["ppo/dropped_group_fraction"] == 0.5
    assert metrics["rollout/uniform_group_fraction"] == 0.5


def test_without_the_flag_every_group_stays():
    trainer = _trainer(_ppo("ppo.drop_uniform_groups=false"))
    batch = _rollout([1., 1., 1., 1., 1., 0., 0., 1.])
    train, metrics = trainer.assemble(batch, OutcomeReward()(batch)[0], trainer.plan(batch, 0))
    assert torch.equal(train.response_mask, batch.response_mask)
    assert "ppo/dropped_groups" not in metrics and metrics["rollout/uniform_group_fraction"] == 0.5


def test_the_loss_denominator_counts_only_the_kept_rows():
    # at the first step the ratio is 1, so the token-mean policy loss is -mean(advantage) over the tokens
    # of the kept rows; the step rewards give the dropped group non-zero advantages that must not count
    trainer = _trainer(_ppo("ppo.whiten_advantages=false", "ppo.kl_coef=0"))
    batch = _rollout([0., 0., 0., 0., 1., 0., 0., 1.])  # group 0 all wrong
    train, _ = trainer.assemble(batch, _StepNoise()(batch)[0], trainer.plan(batch, 0))
    metrics = trainer.update(train, iteration=0)
    kept = batch.response_mask.clone()
    kept[:4] = 0
    expected = -float(maths.masked_mean(train.advantages, kept))
    everything = -float(maths.masked_mean(train.advantages, batch.response_mask))
    assert abs(expected - everything) > 1e-3  # the check below tells the two apart
    assert metrics["ppo/policy_loss"] == pytest.approx(expected, rel=1e-5)
    assert metrics["ppo/empty_minibatches"] == 0 and metrics["ppo/update_skipped"] == 0


def test_an_iteration_with_every_group_dropped_updates_nothing_and_keeps_the_schedule():
    trainer = _trainer(_ppo("ppo.advantage_estimator=gae"))
    before = [p.detach().clone() for p in trainer.policy.policy_parameters()]
    batch = _rollout([1., 1., 1., 1., 0., 0., 0., 0.])
    train, metrics = trainer.assemble(batch, OutcomeReward()(batch)[0], trainer.plan(batch, 0))
    assert metrics["ppo/dropped_groups"] == 2
    update = trainer.update(train, iteration=0)
    assert update["ppo/update_skipped"] == 1 and update["ppo/empty_minibatches"] == 1
    assert "ppo/policy_loss" not in update and "ppo/first_minibatch_ratio_dev" not in update
    assert all(torch.equal(a, b) for a, b in zip(before, trainer.policy.policy_parameters()))
    # the one planned policy step of this iteration still moved the LR schedule
    assert trainer.policy_steps_taken == 1 and trainer.scheduler.last_epoch == 1


def test_dropping_needs_two_samples_per_prompt():
    cfg = compose_config(["ppo.drop_uniform_groups=true", "ppo.n_samples_per_prompt=1",
                          "ppo.advantage_estimator=gae"])
    with pytest.raises(ConfigError, match="ppo.drop_uniform_groups=true with ppo.n_samples_per_prompt=1"):
        validate_config(cfg)
