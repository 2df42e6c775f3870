"""An update of one optimizer step takes the old logprobs from its own forward (`AssembleSteps.old_from_update`):
the no-grad pass scores the reference alone for the rows the update learns from, and the iteration trains the
same weights to the bit, with the same metrics, as with the policy's no-grad pass. Under both arms' rewards."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from omegaconf import OmegaConf

from conftest import compose_config, tiny_mistral
from prmppo.distributed.ranks import OneProcess
from prmppo.models.policy import LoraPolicy
from prmppo.models.tiny import build_char_tokenizer
from prmppo.ppo.loop import PPOTrainer
from prmppo.rewards.orm import OutcomeReward
from prmppo.rewards.terms import RewardTerm, RewardTerms
from prmppo.rollout.protocol import WeightsSpec
from prmppo.tasks.arith import ArithTask
from test_compiled_graphs import TARGETS, RandomLengthEngine


class DenseReward:
    """The outcome plus a score at every response token: a process reward's shape (the PRM arm's terms)."""

    def __call__(self, batch):
        terms, metrics = OutcomeReward()(batch)
        mask = batch.response_mask
        scores = torch.rand(mask.shape, generator=torch.Generator().manual_seed(int(mask.sum()))) * mask
        return RewardTerms({**terms.terms, "process": RewardTerm(scores, mask.bool())}), metrics


def _trainer(*overrides: str, arm: str = "orm", dtype=torch.float32, critic: bool = False) -> PPOTrainer:
    torch.manual_seed(0)
    task = ArithTask(seed=0, train_size=40, test_size=10)
    task.verify = lambda problem, text: len(text) % 2 == 0  # outcomes mixed within the groups
    tokenizer = build_char_tokenizer(task.alphabet())
    policy = LoraPolicy(tiny_mistral(len(tokenizer)).to(dtype), detach_value_hidden=True, critic=critic, r=4, alpha=8,
                        dropout=0.0, target_modules=TARGETS)
    with torch.no_grad():  # the policy off the reference from the start: a KL pull in every iteration
        for name, p in policy.model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(4)) * 0.5)
    ppo = OmegaConf.to_object(compose_config([
        "debug=smoke", "ppo.iterations=3", "ppo.prompts_per_iteration=4", "ppo.n_samples_per_prompt=4",
        "ppo.minibatch_rows=16", "ppo.micro_batch_rows=4", "ppo.max_new_tokens=12", "ppo.warmup_steps=0",
        "ppo.kl_coef=0.05", "ppo.advantage_estimator=grpo", *overrides]).ppo)
    return PPOTrainer(policy=policy, tokenizer=tokenizer, task=task,
                      reward=OutcomeReward() if arm == "orm" else DenseReward(), engine=RandomLengthEngine(tokenizer),
                      sync=SimpleNamespace(served=WeightsSpec("base", None, 0), maybe_sync=lambda *_: False),
                      ppo=ppo, logger=None, ranks=OneProcess(torch.device("cpu")), seed=0)


def _count_policy_scores(trainer) -> list[bool]:
    """Each policy score's grad mode, appended as it runs (the update's are in grad mode, the no-grad pass's not)."""
    modes, score = [], trainer.policy.score
    trainer.policy.score = lambda *a, **k: modes.append(torch.is_grad_enabled()) or score(*a, **k)
    return modes


@pytest.mark.parametrize("arm, overrides, dtype", [
    ("orm", (), torch.float32),
    ("prm", (), torch.float32),
    ("orm", ("ppo.advantage_estimator=rloo", "ppo.drop_uniform_groups=true", "ppo.kl_estimator=k3"), torch.float32),
    ("prm", (), torch.bfloat16),
], ids=["orm", "prm", "rloo_dropped_groups_k3", "prm_bf16"])
def test_one_step_trains_the_weights_of_the_two_pass_iteration_to_the_bit(arm, overrides, dtype):
    fast, slow = _trainer(*overrides, arm=arm, dtype=dtype), _trainer(*overrides, arm=arm, dtype=dtype)
    slow.old_from_update = lambda plan: False  # the policy's no-grad pass, as for several optimizer steps
    fast_modes, slow_modes = _count_policy_scores(fast), _count_policy_scores(slow)
    for iteration in range(3):
        a, b = fast.iteration(iteration), slow.iteration(iteration)
        assert {k: v for k, v in a.items() if not k.startswith("perf/")} == \
            {k: v for k, v in b.items() if not k.startswith("perf/")}
        for (name, p), q in zip(fast.policy.model.named_parameters(), slow.policy.model.parameters()):
            assert torch.equal(p, q), f"iteration {iteration}: {name}"
    assert a["ppo/kl_ref"] != 0 and a["ppo/first_minibatch_ratio_dev"] == 0.0
    # the update's micro-batches score the policy in grad mode in both; the no-grad pass scores it only in `slow`,
    # and in `fast` only for rows of dropped groups, which the update does not run
    assert fast_modes.count(True) == slow_modes.count(True) > 0
    no_grad_fast, no_grad_slow = fast_modes.count(False), slow_modes.count(False)
    assert no_grad_slow >= slow_modes.count(True)
    assert no_grad_fast < no_grad_slow
    if "ppo.drop_uniform_groups=true" not in overrides:
        assert no_grad_fast == 0


@pytest.mark.parametrize("arm", ["orm", "prm"])
def test_a_dropped_groups_rows_beside_kept_rows_keep_their_old_logprobs(arm):
    """Groups of 3 in micro-batches of 4: a dropped group's rows share micro-batches with rows the update learns
    from. The update writes back the old logprobs of the rows it learns from only; a dropped row's (0 under the
    update's mask) stay the no-grad pass's, which the KL metrics read."""
    overrides = ("ppo.advantage_estimator=rloo", "ppo.drop_uniform_groups=true", "ppo.kl_estimator=k3",
                 "ppo.n_samples_per_prompt=3", "ppo.minibatch_rows=12")
    fast, slow = _trainer(*overrides, arm=arm), _trainer(*overrides, arm=arm)
    slow.old_from_update = lambda plan: False
    mixed = 0
    for iteration in range(4):
        batch = fast.sample(iteration)  # the rollout the iteration below samples again (seeded by the iteration)
        keep, plan = fast._kept_rows(batch)[0], fast.plan(batch, iteration)
        mixed += sum(0 < int(keep[rows].sum()) < len(rows) for rows in plan.epochs[0][0].micro_batches)
        a, b = fast.iteration(iteration), slow.iteration(iteration)
        assert {k: v for k, v in a.items() if not k.startswith("perf/")} == \
            {k: v for k, v in b.items() if not k.startswith("perf/")}, f"iteration {iteration}"
    assert mixed > 0  # the case under test happened


def test_several_optimizer_steps_or_a_critic_keep_the_policys_no_grad_pass():
    for trainer in (_trainer("ppo.minibatch_rows=8"), _trainer("ppo.ppo_epochs=2"),
                    _trainer("ppo.advantage_estimator=gae", critic=True)):
        assert not trainer.old_from_update(trainer.plan(trainer.sample(0), 0))
    trainer = _trainer()
    assert trainer.old_from_update(trainer.plan(trainer.sample(0), 0))

