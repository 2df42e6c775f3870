"""The decode-attention benchmark's CPU smoke run: every side it names prints a row, the ones CPU sdpa and CPU
flex_attention can run print a time, and the bound row is the keys and values read once."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # a benchmark at a toy size

REPO = Path(__file__).resolve().parents[2]


def test_cpu_smoke_run_prints_every_side_and_the_bound():
    out = subprocess.run([sys.executable, str(REPO / "benchmarks" / "decode_attention_bench.py"), "--rows", "4",
                          "--slots", "32", "--device", "cpu", "--calls", "2", "--tbps", "1"],
                         capture_output=True, text=True, timeout=300, check=True).stdout
    rows = {line.split(" | ")[1]: line.split(" | ")[2] for line in out.splitlines() if line.startswith("| 32 |")}
    assert len(rows) == 12, out
    assert float(rows["sdpa math, additive mask"]) > 0 and float(rows["two matmuls, float32 softmax"]) > 0
    assert float(rows["flex, compiled, folded query"]) > 0 and float(rows["flex, compiled, H heads, enable_gqa"]) > 0
    # (the dynamic-shape flex side may print inductor's CPU compile error instead: the bench goes on past it)
    # 4 rows x 2 KV heads x 32 slots x 64 dims x 4 bytes, keys and values, at 1 TB/s: 0.13 us
    assert rows["bound: keys and values read once at 1.0 TB/s"] == "0.1"
