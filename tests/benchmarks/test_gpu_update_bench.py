"""benchmarks/gpu_update_bench.py runs end to end on CPU at a toy size and reports the update."""

from __future__ import annotations

import runpy
import sys
from pathlib import Path

import pytest

# benchmarks at a toy size, not what a run needs
pytestmark = pytest.mark.slow

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_update_bench.py"
TOY = ["--shape", "tiny-qwen2", "--vocab", "300", "--rows", "4", "--prompt-tokens", "6", "--new-tokens", "8",
       "--min-new-tokens", "2", "--repeats", "1", "--peak-tflops", "1"]


@pytest.mark.parametrize("mode", [["--lora"], ["--critic", "--gradient-checkpointing", "--micro-batch-tokens", "40"]])
def test_bench_reports_the_update(monkeypatch, capsys, mode):
    monkeypatch.setattr(sys, "argv", [str(BENCH), *TOY, *mode])
    with pytest.raises(SystemExit) as done:
        runpy.run_path(str(BENCH), run_name="__main__")
    assert done.value.code == 0
    out = capsys.readouterr().out
    policy = "LoRA r 16" if "--lora" in mode else "full"
    rows = [line.split(" | ") for line in out.splitlines() if line.startswith(f"| {policy} |")]
    assert len(rows) == 1 and rows[0][3].endswith("%")  # MFU printed against --peak-tflops
    assert float(rows[0][1]) > 0 and float(rows[0][6].rstrip(" |")) < 1e-3  # seconds; first ratio dev
    assert "N = " in out


def test_bench_refuses_rows_that_minibatches_do_not_divide(monkeypatch):
    monkeypatch.setattr(sys, "argv", [str(BENCH), *TOY, "--minibatch-rows", "3"])
    with pytest.raises(SystemExit) as done:
        runpy.run_path(str(BENCH), run_name="__main__")
    assert done.value.code == 2
