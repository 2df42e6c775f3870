"""The PPO stage's launch checks read the modules trained in full from the lora group's schema: the
adapter's `lora.modules_to_save`, and none under full fine-tuning (whose schema has no such key)."""

from __future__ import annotations

from conftest import compose_config

from prmppo.stages.inputs import _modules_to_save


def test_the_adapter_s_modules_to_save_are_the_ones_checked():
    cfg = compose_config(["lora.modules_to_save=[model.norm,lm_head]"])
    assert _modules_to_save(cfg.lora) == ["model.norm", "lm_head"]


def test_full_fine_tuning_trains_no_module_beside_an_adapter():
    assert _modules_to_save(compose_config(["lora=none"]).lora) == []
