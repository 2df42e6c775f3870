"""`topology.cuda_alloc_conf`: the CUDA allocator settings the trainer and its rollout worker start with."""

from __future__ import annotations

import pytest

from prmppo.app import cuda_allocator_settings
from conftest import compose_config


@pytest.mark.parametrize("topology", ["cpu", "gpu", "fsdp"])
def test_every_topology_asks_for_expandable_segments(topology):
    assert compose_config([f"topology={topology}"]).topology.cuda_alloc_conf == "expandable_segments:True"


def test_the_setting_is_put_in_the_environment_unless_the_user_set_one(monkeypatch):
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    assert cuda_allocator_settings("") is None  # empty: the allocator's defaults
    assert cuda_allocator_settings("expandable_segments:True") == "expandable_segments:True"
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:128")
    assert cuda_allocator_settings("expandable_segments:True") == "max_split_size_mb:128"  # the user's wins
