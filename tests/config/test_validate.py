"""`inert_keys`: the keys a config never reads, each listed exactly where the code skips it.

Each case composes the real config with the choice that turns a reader off, and the one that turns it
back on: a key missing from the first list, or present in the second, would split report groups over
settings that change nothing, or merge groups over settings that do."""

from __future__ import annotations

import pytest

from conftest import compose_config
from prmppo.config.validate import inert_keys


def _inert(*overrides: str) -> set[str]:
    return set(inert_keys(compose_config(list(overrides))))


def test_lora_dropout_is_inert_while_lora_none_has_no_such_key():
    # the no-grad pass and the update both run with dropout off (tests/ppo/test_loop.py checks the ratio)
    assert "lora.dropout" in _inert("lora=adapter")
    assert not any(key.startswith("lora.") for key in _inert("lora=none"))


def test_the_group_std_floor_is_read_by_grpo_alone():
    assert "ppo.group_std_floor" in _inert("ppo.advantage_estimator=rloo")
    assert "ppo.group_std_floor" in _inert("ppo.advantage_estimator=gae")
    assert "ppo.group_std_floor" not in _inert("ppo.advantage_estimator=grpo")


def test_the_canary_keys_are_inert_while_the_canary_is_off():
    assert {"canary.n_problems", "canary.max_drop"} <= _inert("canary.every=0")
    assert not {"canary.n_problems", "canary.max_drop"} & _inert("canary.every=5")
    assert "canary.every" not in _inert("canary.every=0")  # the switch itself is read


def test_the_during_ppo_eval_keys_are_inert_while_that_evaluation_is_off():
    keys = {"eval.during_ppo_problems", "eval.during_ppo_k"}
    assert keys <= _inert("eval.every=0")
    assert not keys & _inert("eval.every=10")
    assert not {"eval.k", "eval.n_problems", "eval.temperature"} & _inert("eval.every=0")  # the final evaluation's


@pytest.mark.parametrize("overrides", [["arm=orm"], ["arm=orm", "stage=ppo"], ["reward=prm_oracle"],
                                       ["arm=prm", "stage=sft"]], ids=["orm", "orm-ppo", "oracle", "prm-sft"])
def test_prm_train_is_inert_where_no_prm_is_trained(overrides):
    inert = _inert(*overrides)
    assert {"prm_train.steps", "prm_train.lr", "prm_train.head", "prm_train.label_source"} <= inert
    # a step-level reward still scores steps, so its scorer's rows per forward stay read
    scores_steps = overrides == ["reward=prm_oracle"]
    assert ("prm_train.chunk_rows" in inert) is not scores_steps


@pytest.mark.parametrize("overrides", [["arm=prm"], ["arm=prm", "stage=ppo"], ["arm=orm", "stage=prm"]],
                         ids=["prm", "prm-ppo", "prm-stage"])
def test_prm_train_is_read_where_a_prm_is_trained(overrides):
    assert not any(key.startswith("prm_train.") for key in _inert(*overrides))


def test_each_engine_leaves_the_others_key_inert():
    assert "rollout.gpu_memory_utilization" in _inert("rollout=hf")
    assert not {"rollout.decode", "rollout.compile_decode"} & set(_inert("rollout=hf"))
    assert {"rollout.decode", "rollout.compile_decode"} <= set(_inert("rollout=vllm"))
    assert "rollout.gpu_memory_utilization" not in _inert("rollout=vllm")


def test_in_process_engine_leaves_the_workers_keys_inert():
    inert = _inert("rollout=inprocess")
    assert {"rollout.python", "rollout.standby", "rollout.request_timeout_s", "topology.engine_device",
            "rollout.gpu_memory_utilization"} <= set(inert)
    assert not {"rollout.decode", "rollout.compile_decode"} & set(inert)  # it runs the built-in engine's loop
    assert "rollout.python" not in _inert("rollout=hf")
