"""Every default has one home, the schema: a component built without a key gets the schema's value."""

from __future__ import annotations

import dataclasses
import inspect

import pytest

from prmppo.config.schema import (ArithTaskConfig, ExternalProcessRewardConfig, GSM8KTaskConfig, HFModelConfig,
                                  JsonlTaskConfig, LoraAdapterConfig, OutcomeRewardConfig, PPOConfig,
                                  ProcessRewardConfig, RolloutConfig, TinyModelConfig)
from prmppo.models.loading import HFDirSource
from prmppo.models.policy import LoraPolicy
from prmppo.models.tiny import TinyModelSource
from prmppo.ppo import advantages
from prmppo.rewards.orm import OutcomeReward
from prmppo.rewards.prm import ProcessReward
from prmppo.rewards.prm_external import ExternalProcessReward
from prmppo.rollout.client import RolloutClient
from prmppo.tasks.arith import parse_difficulty, ArithTask
from prmppo.tasks.gsm8k import GSM8KTask
from prmppo.tasks.jsonl import JsonlTask

PAIRS = [(ArithTask, ArithTaskConfig), (GSM8KTask, GSM8KTaskConfig), (TinyModelSource, TinyModelConfig),
         (HFDirSource, HFModelConfig), (OutcomeReward, OutcomeRewardConfig), (ProcessReward, ProcessRewardConfig),
         (LoraPolicy, LoraAdapterConfig), (JsonlTask, JsonlTaskConfig),
         (ExternalProcessReward, ExternalProcessRewardConfig)]


@pytest.mark.parametrize("component,schema", PAIRS, ids=[c.__name__ for c, _ in PAIRS])
def test_keyword_defaults_are_the_schemas(component, schema):
    defaults = schema()
    parameters = inspect.signature(component).parameters
    checked = 0
    for field in dataclasses.fields(schema):
        if field.name == "_target_" or field.name not in parameters:
            continue
        default = parameters[field.name].default
        if default is inspect.Parameter.empty or default is None and getattr(defaults, field.name) is not None:
            continue  # required, or None standing for the schema's list / mapping (checked below)
        assert default == getattr(defaults, field.name), f"{component.__name__}({field.name}=...)"
        checked += 1
    assert checked >= 1


def test_list_and_mapping_defaults_are_the_schemas():
    for key in ("sft", "rl"):
        chain = getattr(ArithTaskConfig(), key)
        assert parse_difficulty(key, None) == parse_difficulty(key, dataclasses.asdict(chain))
    assert parse_difficulty("sft", None).max_operands == ArithTaskConfig().sft.max_operands


def test_rollout_client_has_no_timeout_defaults():
    parameters = inspect.signature(RolloutClient).parameters
    for key in ("startup_timeout_s", "request_timeout_s", "heartbeat_timeout_s"):
        assert parameters[key].default is inspect.Parameter.empty and hasattr(RolloutConfig, key)


def test_the_advantage_rule_has_no_defaults_for_grpo_settings():
    # the loop passes ppo.group_std_floor and ppo.group_same_tol; a keyword default would be a second home
    parameters = inspect.signature(advantages.compute).parameters
    for key in ("group_std_floor", "group_same_tol"):
        assert parameters[key].default is inspect.Parameter.empty and hasattr(PPOConfig, key)
