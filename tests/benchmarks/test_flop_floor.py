"""benchmarks/flop_floor.py's counts of an iteration's FLOPs and decode bytes, against numbers worked out by hand."""

from __future__ import annotations

import runpy
from pathlib import Path
from types import SimpleNamespace

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "flop_floor.py"
# tiny-qwen2 of scripts/make_shape_model.py with a vocabulary of 100: 2 layers, hidden 64, MLP 128,
# 4 query heads and 2 KV heads of 16 (q width 64, kv width 32)
TINY = ["--shape", "tiny-qwen2", "--vocab", "100", "--prompt-tokens", "3", "--new-tokens", "4", "--rows", "2"]


@pytest.fixture(scope="module")
def bench():
    return SimpleNamespace(**runpy.run_path(str(BENCH)))  # the script's functions, not run as __main__


def test_the_counts_of_a_tiny_shape(bench):
    args = bench.parse_args(TINY)
    d = bench.dims(args.config)
    # per layer 64 x (2 x 64 + 2 x 32) + 3 x 64 x 128 = 36,864; two layers and the head 64 x 100: 80,128
    assert bench.matmul_weights(d) == 80_128
    assert bench.attention_flops(d, 10) == 2 * 4 * 64 * 10
    flops = bench.phase_flops(d, rows=2, prompt=3, new=4, no_grad_passes=2, lora=True, checkpointing=True)
    # 14 tokens: the forward's matmuls 2 x 80,128 x 14 = 2,243,584; attention 14 x 512 x (7 + 1) / 2 = 28,672
    assert flops["no_grad"] == 2 * (2_243_584 + 28_672)
    # prefill: 2 rows x 3 x (160,256 + 512 x 2); decode: 2 x 4 x (160,256 + 512 x (3 + 2.5))
    assert flops["generation_prefill"] == 967_680 and flops["generation_decode"] == 1_304_576
    # LoRA, checkpointed: matmuls forward + recompute + input gradients; attention forward + recompute + 2
    assert flops["update"] == 3 * 2_243_584 + 4 * 28_672
    full = bench.phase_flops(d, rows=2, prompt=3, new=4, no_grad_passes=2, lora=False, checkpointing=False)
    assert full["update"] == 3 * 2_243_584 + 3 * 28_672  # forward, input and weight gradients; no recompute


def test_the_decode_steps_read_the_weights_and_the_kv_cache(bench):
    args = bench.parse_args(TINY + ["--tbps", "1e-6", "--tflops", "1"])
    d = bench.dims(args.config)
    # 2 layers x K and V x 32 x 2 bytes = 256 bytes a position; 4 steps x (160,256 + 2 rows x 256 x 5.5)
    assert bench.decode_bytes(d, 160_256, 2, 2, 3, 4) == 652_288
    result = bench.floors(d, args)
    # at 1e6 bytes/s the decode steps' memory (0.652 s) outlasts their compute (1.3e6 FLOPs at 1e12/s)
    assert result["seconds"]["generation"] == pytest.approx(967_680 / 1e12 + 0.652288)
    assert result["total_s"] == pytest.approx(sum(result["seconds"].values()))


def test_the_share_of_the_peak_a_target_needs(bench, capsys):
    result = bench.main(TINY + ["--tflops", "1e-6", "--peer-s", "30", "--ratio", "3",
                                "--measured", "update=20"])
    update_floor = (3 * 2_243_584 + 4 * 28_672) / 1e6
    assert result["seconds"]["update"] == pytest.approx(update_floor)
    assert result["target_s"] == 10 and result["needed_peak_share"] == pytest.approx(result["total_s"] / 10)
    out = capsys.readouterr().out
    assert f"| update | {update_floor * 1e6 / 1e12:.1f} | {update_floor:.3f} | 20.000 | {20 / update_floor:.1f}x |" in out


def test_bad_arguments_are_named(bench):
    with pytest.raises(SystemExit):
        bench.parse_args(["--shape", "tiny-qwen2"])  # no prompt length
    with pytest.raises(SystemExit):
        bench.parse_args(TINY + ["--peer-s", "30"])  # a peer time without the ratio
    with pytest.raises(SystemExit, match="no phase"):
        bench.parse_args(TINY + ["--measured", "sampling=3"])
