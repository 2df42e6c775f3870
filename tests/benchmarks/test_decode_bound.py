"""benchmarks/gpu_bench.py's memory-bandwidth bound of a decode step, against numbers worked out by hand."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_bench.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("gpu_bench", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_bound_of_a_7b_decode_step_on_an_h200(bench):
    # Qwen2-7B's attention: 28 layers, 4 KV heads of 128, bf16 (2 bytes): 28 * 2 * 4 * 128 * 2 = 57,344 bytes of
    # K and V per token of context; 256 rows at a mean context of 384: 57,344 * 256 * 384 = 5,637,144,576 bytes
    kv = bench.kv_cache_bytes(layers=28, kv_heads=4, head_dim=128, dtype_bytes=2, rows=256, context_tokens=384)
    assert kv == 5_637_144_576
    # with 13.3e9 bytes of weights: 18,937,144,576 bytes a step; at 4.8e12 bytes/s a step takes 3.945238 ms, and
    # 256 rows / 3.945238 ms = 64,888.3 tokens/s
    bound = bench.decode_bound(weight_bytes=13.3e9, kv_bytes=kv, bandwidth_bytes_per_s=4.8e12, rows=256)
    assert bound == pytest.approx(64_888.3, abs=0.1)


def test_the_figures_read_the_model_config(bench):
    # no head_dim in the config: hidden 896 / 14 heads = 64; 24 layers, 2 KV heads, bf16: 24 * 2 * 2 * 64 * 2 = 12,288
    # bytes per token; 64 rows x 300 tokens: 235,929,600 bytes. Weights 745,200,000 bytes: 981,129,600 a step; at
    # 4.8e12 bytes/s that is 204.4020 us, and 64 rows / 204.4020 us = 313,108.5 tokens/s
    config = {"num_attention_heads": 14, "num_key_value_heads": 2, "hidden_size": 896, "num_hidden_layers": 24}
    figures = bench.bound_figures(config, 745_200_000, 2, 64, 300.0, 4.8e12, "a table")
    assert figures["kv_gb"] == pytest.approx(0.2359296)
    assert figures["bound_tokens_per_s"] == pytest.approx(313_108.5, abs=0.1)
    assert figures["bandwidth_tbps"] == 4.8 and figures["bandwidth_source"] == "a table"


def test_weights_read_per_step_leave_out_an_untied_input_embedding(bench):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    def model(tied: bool):
        config = Qwen2Config(vocab_size=100, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                             num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=tied)
        return Qwen2ForCausalLM(config).to(torch.bfloat16)

    tied, untied = model(True), model(False)
    every = sum(p.numel() for p in tied.parameters()) * 2  # the shared embedding counted once
    assert bench.weight_bytes_per_step(tied) == every
    # untied: a separate 100 x 16 LM head is read whole each step, the input table only gathered
    assert bench.weight_bytes_per_step(untied) == every


def test_a_known_device_reads_the_table_and_an_unknown_one_is_measured(bench, monkeypatch):
    args = type("Args", (), {"peak_tbps": 0.0, "device": "cuda"})()
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device: "NVIDIA H100 80GB HBM3")
    assert bench.bandwidth(args) == (3.35e12, "NVIDIA H100 80GB HBM3 datasheet peak")
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device: "NVIDIA H100 PCIe")
    assert bench.bandwidth(args)[0] == 2.0e12
    args.device = "cpu"
    measured, source = bench.bandwidth(args)
    assert measured > 0 and source.startswith("measured: a 256 MiB copy")
    args.peak_tbps = 1.5
    assert bench.bandwidth(args) == (1.5e12, "--peak-tbps")
