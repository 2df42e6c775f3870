"""The PPO stage with `ppo.compile=true` keeps its compiled graphs in the artifacts dir: a second run of the
same shapes, as a fresh process on a fresh machine given that dir (conftest.py `fresh_compile_process`),
loads them before its first compiled forward and compiles no graph (inductor's FX graph cache: hits, no
misses); with `ppo.compile_cache=false` it compiles cold."""

from __future__ import annotations

import json

import pytest
from omegaconf import open_dict

from conftest import fresh_compile_process
from prmppo.app import run

# two smoke PPO runs whose decoder layers inductor compiles on this CPU: minutes
pytestmark = pytest.mark.slow


def _ppo_run(smoke_cfg, tmp_path, name: str, *overrides: str) -> dict:
    cfg = smoke_cfg("stage=ppo", "ppo.compile=true", "ppo.iterations=1", *overrides)
    with open_dict(cfg):
        cfg.run_dir = str(tmp_path / name)
    with fresh_compile_process():
        run(cfg)
    return json.loads((tmp_path / name / "stage_result.json").read_text())["summary"]


def test_a_second_compiled_run_loads_the_cache_and_compiles_no_graph(smoke_cfg, tmp_path):
    cold = _ppo_run(smoke_cfg, tmp_path, "cold")["compile_cache"]
    assert cold["loaded"] == {} and cold["fxgraph_cache_miss"] >= 1 and cold["fxgraph_cache_hit"] == 0
    files = list((tmp_path / "artifacts" / "compile_cache").glob("*.bin"))
    assert [str(f) for f in files] == [cold["file"]]
    warm = _ppo_run(smoke_cfg, tmp_path, "warm")["compile_cache"]
    assert warm["file"] == cold["file"] and warm["loaded"].get("inductor", 0) >= 1
    assert warm["fxgraph_cache_hit"] >= 1 and warm["fxgraph_cache_miss"] == 0, warm
    banner = json.loads((tmp_path / "warm" / "banner.json").read_text())
    assert "compile_cache" in banner["startup_s"]
    off = _ppo_run(smoke_cfg, tmp_path, "off", "ppo.compile_cache=false")["compile_cache"]
    assert off["file"] is None and off["fxgraph_cache_miss"] >= 1 and off["fxgraph_cache_hit"] == 0
