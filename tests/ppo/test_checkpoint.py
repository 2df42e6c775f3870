"""Resumable PPO checkpoints: exact round trip, only complete checkpoints picked, pruning keeps the newest."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from omegaconf import OmegaConf
from transformers import MistralConfig, MistralForCausalLM

from conftest import compose_config
from prmppo.distributed.ranks import OneProcess
from prmppo.models.policy import FullPolicy, LoraPolicy
from prmppo.ppo.checkpoint import (
    CheckpointError,
    checkpoint_every,
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    prune_checkpoints,
    read_meta,
    save_checkpoint,
)
from prmppo.ppo.loop import PPOTrainer
from prmppo.rewards.prm import ProcessReward

TARGETS = ["q_proj", "v_proj"]


class _Task:
    def problems(self, split):
        return list(range(10))


def _policy(kind: str):
    torch.manual_seed(0)
    cfg = MistralConfig(vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                        tie_word_embeddings=True)
    model = MistralForCausalLM(cfg)
    if kind == "lora":
        return LoraPolicy(model, detach_value_hidden=False, critic=True, r=4, alpha=8, target_modules=TARGETS)
    return FullPolicy(model, detach_value_hidden=False, critic=True)


def _trainer(policy, label_noise: float = 0.5):
    # gae: the critic and its optimizer travel too
    ppo = OmegaConf.to_object(compose_config(["debug=smoke", "ppo.iterations=4", "ppo.advantage_estimator=gae"]).ppo)
    reward = ProcessReward(label_noise=label_noise, seed=0)  # the reward with state: its label-noise generator
    return PPOTrainer(policy=policy, tokenizer=None, task=_Task(), reward=reward, engine=None, sync=None, ppo=ppo,
                      logger=None, ranks=OneProcess(torch.device("cpu")), seed=0)


def _step(policy, trainer):
    """One optimizer step of both optimizers on a made-up loss, as PPOTrainer._step does."""
    ids = torch.randint(4, 24, (2, 8), generator=torch.Generator().manual_seed(trainer.policy_steps_taken))
    att = torch.ones_like(ids)
    logits, values = policy.forward(ids, att, att.cumsum(-1) - 1)
    (logits.float().logsumexp(-1).mean() + values.square().mean()).backward()
    trainer._step(train_policy=True)


def _state(policy, trainer) -> dict[str, torch.Tensor]:
    state = {f"model.{k}": v for k, v in policy.model.state_dict().items()}
    state.update({f"value_head.{k}": v for k, v in policy.value_head.state_dict().items()})
    for name in ("policy_optimizer", "value_optimizer"):
        for index, slots in getattr(trainer, name).state_dict()["state"].items():
            state.update({f"{name}.{index}.{k}": torch.as_tensor(v) for k, v in slots.items()})
    return state


@pytest.mark.parametrize("kind", ["lora", "full"])
def test_round_trip_restores_weights_optimizers_scheduler_counters_and_rng(tmp_path, kind):
    policy = _policy(kind)
    trainer = _trainer(policy)
    for _ in range(3):
        _step(policy, trainer)
    trainer.skipped_steps = 1  # counters travel as they are
    torch.rand(5, generator=trainer.reward.noise_generator)  # the label noise drew flips for some steps
    saved = save_checkpoint(tmp_path / "checkpoints", 2, policy, trainer, {"alarms": [{"iteration": 1}]})
    rng_at_save = torch.get_rng_state()

    fresh = _policy(kind)
    fresh_trainer = _trainer(fresh)
    untrained = {k: v.clone() for k, v in fresh.model.state_dict().items()}
    assert any(not torch.equal(v, policy.model.state_dict()[k]) for k, v in untrained.items()), \
        "nothing trained: the round trip would prove nothing"
    torch.manual_seed(123)  # the load must restore the generator, not keep this one
    assert load_checkpoint(saved, fresh, fresh_trainer) == 2
    expected, actual = _state(policy, trainer), _state(fresh, fresh_trainer)
    assert expected.keys() == actual.keys()
    for key in expected:
        assert torch.equal(expected[key], actual[key]), key  # bit-identical, not merely close
    assert fresh_trainer.scheduler.state_dict() == trainer.scheduler.state_dict()
    assert fresh_trainer.scheduler.get_last_lr() == trainer.scheduler.get_last_lr()
    assert (fresh_trainer.policy_steps_taken, fresh_trainer.skipped_steps) == (3, 1)
    assert fresh_trainer.skip_budget.steps == trainer.skip_budget.steps == 3
    assert torch.equal(torch.get_rng_state(), rng_at_save)
    assert torch.equal(fresh_trainer.reward.noise_generator.get_state(), trainer.reward.noise_generator.get_state())
    assert read_meta(saved)["extra"] == {"alarms": [{"iteration": 1}]}
    # one more step from the same state gives the same weights: the Adam moments came back too
    _step(policy, trainer)
    _step(fresh, fresh_trainer)
    after, fresh_after = _state(policy, trainer), _state(fresh, fresh_trainer)
    for key in after:
        assert torch.equal(after[key], fresh_after[key]), key


def test_tensor_files_load_with_weights_only(tmp_path):
    policy = _policy("lora")
    saved = save_checkpoint(tmp_path / "checkpoints", 1, policy, _trainer(policy))
    for name in ("optim.pt", "rng.pt", "reward.pt"):
        torch.load(saved / name, weights_only=True)  # raises if anything but tensors/containers was pickled
    assert (saved / "value_head.safetensors").is_file() and list((saved / "adapter").rglob("*.safetensors"))
    assert saved.name == "it000001" and not list(saved.parent.glob("*.partial"))


def test_partial_and_unmarked_dirs_are_never_picked(tmp_path):
    policy = _policy("lora")
    trainer = _trainer(policy)
    checkpoints = tmp_path / "checkpoints"
    good = save_checkpoint(checkpoints, 1, policy, trainer)
    # a save killed before the rename, and one whose marker never got written: both newer
    shutil.copytree(good, checkpoints / "it000003.partial")
    shutil.copytree(good, checkpoints / "it000002")
    (checkpoints / "it000002" / "checkpoint.json").unlink()
    (checkpoints / "final").mkdir()
    assert latest_checkpoint(tmp_path) == good
    assert list_checkpoints(checkpoints) == [good]
    assert latest_checkpoint(tmp_path / "elsewhere") is None


def test_truncated_file_is_detected_not_loaded(tmp_path):
    policy = _policy("lora")
    trainer = _trainer(policy)
    saved = save_checkpoint(tmp_path / "checkpoints", 1, policy, trainer)
    optim = saved / "optim.pt"
    optim.write_bytes(optim.read_bytes()[:100])
    with pytest.raises(CheckpointError, match=r"optim.pt is missing or truncated"):
        load_checkpoint(saved, _policy("lora"), _trainer(_policy("lora")))


def test_resume_with_a_different_horizon_is_refused(tmp_path):
    policy = _policy("lora")
    saved = save_checkpoint(tmp_path / "checkpoints", 1, policy, _trainer(policy))
    meta = json.loads((saved / "checkpoint.json").read_text())
    meta["planned_policy_steps"] = 999
    (saved / "checkpoint.json").write_text(json.dumps(meta))
    with pytest.raises(CheckpointError, match=r"999 planned policy optimizer steps; this config plans 8"):
        load_checkpoint(saved, _policy("lora"), _trainer(_policy("lora")))


def _drop_reward_state(saved) -> None:
    """Make `saved` look like a checkpoint written before `reward.pt` existed."""
    (saved / "reward.pt").unlink()
    meta = json.loads((saved / "checkpoint.json").read_text())
    del meta["files"]["reward.pt"]
    (saved / "checkpoint.json").write_text(json.dumps(meta))


def test_checkpoint_without_reward_state_resumes_only_a_reward_without_noise(tmp_path):
    policy = _policy("lora")
    saved = save_checkpoint(tmp_path / "checkpoints", 1, policy, _trainer(policy))
    _drop_reward_state(saved)
    assert load_checkpoint(saved, _policy("lora"), _trainer(_policy("lora"), label_noise=0.0)) == 1
    with pytest.raises(CheckpointError, match=r"predates reward.pt, so a resume would flip other steps"):
        load_checkpoint(saved, _policy("lora"), _trainer(_policy("lora"), label_noise=0.5))


def test_reward_state_of_other_reward_settings_is_refused(tmp_path):
    policy = _policy("lora")
    saved = save_checkpoint(tmp_path / "checkpoints", 1, policy, _trainer(policy, label_noise=0.5))
    with pytest.raises(CheckpointError, match=r"reward.label_noise=0.0 needs \[\]\): resume with the reward"):
        load_checkpoint(saved, _policy("lora"), _trainer(_policy("lora"), label_noise=0.0))


def test_pruning_keeps_the_newest_and_pinned(tmp_path):
    checkpoints = tmp_path / "checkpoints"
    for it in (1, 2, 3, 4):
        (checkpoints / f"it{it:06d}").mkdir(parents=True)
        (checkpoints / f"it{it:06d}" / "checkpoint.json").write_text("{}")
    (checkpoints / "it000005.partial").mkdir()  # a killed save: garbage
    (checkpoints / "final").mkdir()
    pinned = (checkpoints / "it000001",)
    deleted = prune_checkpoints(checkpoints, keep=2, pinned=pinned)
    assert sorted(p.name for p in deleted) == ["it000002", "it000005.partial"]
    assert sorted(p.name for p in checkpoints.iterdir()) == ["final", "it000001", "it000003", "it000004"]
    prune_checkpoints(checkpoints, keep=0)  # keep < 1 still keeps the newest
    assert sorted(p.name for p in checkpoints.iterdir()) == ["final", "it000004"]


@pytest.mark.parametrize("iterations, sync_every, expected", [
    (100, 1, 25),  # ceil(100 / 4)
    (4, 1, 1),
    (2, 1, 1),
    (100, 10, 30),  # 25 rounded up to a multiple of the sync period
    (10, 4, 4),  # ceil(10 / 4) = 3 < sync period
])
def test_checkpoint_cadence_is_about_four_per_run_on_sync_boundaries(iterations, sync_every, expected):
    assert checkpoint_every(iterations, sync_every) == expected
