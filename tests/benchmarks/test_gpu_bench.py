"""The GPU rollout benchmark's CPU smoke run: a tiny Qwen2 built by make_shape_model.py, a few GSM8K-format
rows, every side forced to the full number of new tokens, the figures written as JSON, the static side profiled."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

# benchmarks at a toy size, not what a run needs
pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]


def write_gsm8k(directory: Path) -> None:
    directory.mkdir()
    rows = [{"question": f"Tom has {a} apples and buys {b} more. How many apples does he have?",
             "answer": f"Tom has {a} + {b} = <<{a}+{b}={a + b}>>{a + b} apples.\n#### {a + b}"}
            for a, b in [(3, 4), (10, 12), (7, 1), (25, 30), (2, 9), (14, 6)]]
    for name in ("train.jsonl", "test.jsonl"):
        (directory / name).write_text("".join(json.dumps(row) + "\n" for row in rows))


def test_cpu_smoke_run_writes_forced_length_figures(tmp_path):
    write_gsm8k(tmp_path / "gsm8k")
    command = [sys.executable, str(REPO / "benchmarks" / "gpu_bench.py"), "--shape", "tiny-qwen2", "--vocab", "400",
               "--model", str(tmp_path / "model"), "--data-dir", str(tmp_path / "gsm8k"), "--rows", "8",
               "--new-tokens", "16", "--repeats", "1", "--decode", "static", "dynamic", "--compile-decode", "--device",
               "cpu", "--profile", "--out", str(tmp_path / "out")]
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    results = json.loads((tmp_path / "out" / "gpu_bench.json").read_text())
    sides = results["rows"]["8"]
    assert set(sides) == {"generate", "engine:static", "engine:dynamic", "engine:static+compile"}
    assert all(side["tokens"] == 8 * 16 and side["tokens_per_s"] > 0 for side in sides.values())
    assert sides["generate"]["x_generate"] == 1.0
    assert sides["engine:static"]["loop"] == "static" and sides["engine:dynamic"]["loop"] == "dynamic"
    assert sides["engine:static"]["decode_attention"] == "prmppo_grouped"
    assert sides["engine:dynamic"]["decode_attention"] is None
    assert sides["engine:static+compile"]["loop"] == "static"
    assert results["device"].startswith("CPU") and "engine:static" in done.stdout
    # the decode bound: on a CPU the bandwidth is a measured copy, and every side is a percentage of the bound
    bound = results["bound"]["8"]
    assert bound["bandwidth_source"].startswith("measured: a 256 MiB copy") and bound["bound_tokens_per_s"] > 0
    assert bound["weight_gb"] > 0 and bound["kv_gb"] > 0 and bound["mean_context"] > 16 / 2
    for side in sides.values():
        assert side["pct_of_bound"] == pytest.approx(100 * side["tokens_per_s"] / bound["bound_tokens_per_s"], abs=0.01)
    assert "decode-step memory-bandwidth bound" in done.stdout and "measured: a 256 MiB copy" in done.stdout
    # --profile: the static sides only (the compiled one too), their ops by self time, printed and written
    profile = (tmp_path / "out" / "gpu_bench_profile.txt").read_text()
    assert profile.startswith("engine:static, 8 rows x 16 new tokens") and "engine:dynamic" not in profile
    assert "\nengine:static+compile, 8 rows x 16 new tokens" in profile
    assert "aten::" in profile and "Self CPU" in profile and profile.splitlines()[1] in done.stdout


def test_refuses_rows_that_samples_do_not_divide(tmp_path):
    command = [sys.executable, str(REPO / "benchmarks" / "gpu_bench.py"), "--rows", "6", "--samples", "4",
               "--out", str(tmp_path)]
    done = subprocess.run(command, env={**os.environ, "PYTHONPATH": str(REPO / "src")}, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 2 and "--rows [6] must be positive multiples of --samples 4" in done.stderr
