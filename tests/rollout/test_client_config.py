"""The rollout worker's client is built from the run's `rollout` node, whose schema holds its defaults."""

from __future__ import annotations

import json

import pytest

from conftest import compose_config
from prmppo.config.build import build
from prmppo.models.loading import HFDirSource
from prmppo.models.tiny import TinyModelSource
from prmppo.rollout.client import RolloutClient
from prmppo.rollout.worker import build_engine
from rollout.test_hf_engine import EOS, PAD, PROMPTS, save_tiny_model


def _client(tmp_path, overrides):
    cfg = compose_config(overrides)
    return cfg, build(cfg.rollout, "rollout worker client", spool_dir=tmp_path / "spool", base_model_dir=str(tmp_path),
                      log_path=tmp_path / "worker.log", device="cpu", dtype="float32", lora_rank=8, seed=5)


def test_client_takes_every_timeout_from_the_config(tmp_path):
    cfg, client = _client(tmp_path, ["rollout.request_timeout_s=77"])
    assert isinstance(client, RolloutClient) and client.engine == "hf"
    assert client.engine_options == {"decode": "static", "compile_decode": False}
    assert (client.startup_timeout_s, client.request_timeout_s, client.heartbeat_timeout_s) == (
        cfg.rollout.startup_timeout_s, 77, cfg.rollout.heartbeat_timeout_s)


def test_hf_client_passes_the_decode_loop(tmp_path):
    _, client = _client(tmp_path, ["rollout.decode=dynamic"])
    assert client.engine_options == {"decode": "dynamic", "compile_decode": False}


def test_the_worker_engine_built_from_the_clients_options_compiles_its_decode_step(tmp_path, decode_step_graphs):
    """rollout=hf rollout.compile_decode=true: the options the client sends (through JSON, as the worker reads
    them) build an engine whose decode step dynamo traces, sampling the eager engine's tokens."""
    graphs = decode_step_graphs.graphs
    _, client = _client(tmp_path, ["rollout.decode=static_eager", "rollout.compile_decode=true"])
    options = json.loads(json.dumps(client.engine_options))
    assert options == {"decode": "static_eager", "compile_decode": True}
    model_dir = save_tiny_model(tmp_path / "model", seed=0)
    compiled = build_engine("hf", model_dir, "cpu", "float32", options)
    eager = build_engine("hf", model_dir, "cpu", "float32", {**options, "compile_decode": False})
    want = eager.generate(PROMPTS, 3, 8, 1.0, 1.0, 4, EOS, PAD)
    assert not graphs
    got = compiled.generate(PROMPTS, 3, 8, 1.0, 1.0, 4, EOS, PAD)
    assert graphs and got[0] == want[0]
    for got_row, want_row in zip(got[1], want[1]):
        assert got_row == pytest.approx(want_row, abs=1e-5)


def test_client_has_no_timeout_defaults_of_its_own(tmp_path):
    with pytest.raises(TypeError, match="request_timeout_s"):
        RolloutClient(tmp_path / "spool", "hf", str(tmp_path), tmp_path / "worker.log", startup_timeout_s=1,
                      heartbeat_timeout_s=1)


@pytest.mark.parametrize("sync,rank", [("checkpoint", 0), ("adapter", 8)])
def test_vllm_client_reserves_the_lora_rank_only_for_adapter_sync(tmp_path, sync, rank):
    _, client = _client(tmp_path, ["rollout=vllm", f"rollout.sync={sync}", "rollout.gpu_memory_utilization=0.2",
                                   "rollout.python=/bin/true"])
    assert client.engine_options == {"gpu_memory_utilization": 0.2, "seed": 5, "max_lora_rank": rank}


def test_model_sources_report_their_architecture_without_weights(tmp_path):
    tiny, where = TinyModelSource(hidden_size=48, num_attention_heads=3, num_key_value_heads=1).architecture()
    assert (tiny["model_type"], tiny["hidden_size"], tiny["num_attention_heads"]) == ("mistral", 48, 3)
    assert where == "model.hidden_size=48 / model.num_attention_heads=3"
    assert HFDirSource(str(tmp_path)).architecture() == (None, "")  # no config.json yet
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen2", "hidden_size": 896}))
    found, where = HFDirSource(str(tmp_path)).architecture()
    assert found["model_type"] == "qwen2" and where == str(tmp_path / "config.json")
