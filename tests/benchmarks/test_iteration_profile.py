"""benchmarks/iteration_profile.py runs trl_compare.py's prmppo side on CPU at a toy size and records each phase."""

from __future__ import annotations

import json
import os
import runpy
import subprocess
import sys
from pathlib import Path

import pytest

from tests.benchmarks.test_gpu_bench import write_gsm8k

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "benchmarks" / "iteration_profile.py"


def test_profile_records_every_iteration_and_profiles_the_one_asked(tmp_path):
    data, model, out = tmp_path / "gsm8k", tmp_path / "model", tmp_path / "prof"
    write_gsm8k(data)
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    subprocess.run([sys.executable, str(ROOT / "scripts" / "make_shape_model.py"), "--out", str(model), "--shape",
                    "tiny-qwen2", "--vocab", "400", "--data-dir", str(data)], check=True, capture_output=True, env=env)
    command = [sys.executable, str(BENCH), "--out", str(out), "--profile-iteration", "1", "--sync-iteration", "0", "--stack", "--",
               "--model", str(model), "--data-dir", str(data), "--engine", "inprocess", "--sync", "none",
               "--iterations", "2", "--device", "cpu", "--prompts", "2", "--group", "2", "--new-tokens", "4",
               "--minibatch-rows", "4", "--micro-rows", "2"]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = [json.loads(line) for line in (out / "phases.jsonl").read_text().splitlines()]
    assert [row["iteration"] for row in rows] == [0, 1]
    for row in rows:
        assert all(row[phase]["seconds"] > 0 for phase in ("sample", "assemble", "update"))
    phases = (out / "phases.txt").read_text()
    assert all(f"phase:{name}" in phases for name in ("sample", "assemble", "update"))
    assert "aten::" in (out / "ops_cpu.txt").read_text()
    assert (out / "run" / "metrics.jsonl").exists()
    assert (out / "syncs.txt").read_text().startswith("0 synchronisations")  # a CPU run has no device to wait for
    kernels = (out / "kernels_by_phase.txt").read_text()  # no device work on CPU: each phase is one idle gap
    assert "the host in those gaps, by innermost frame of src/prmppo:" in kernels
    assert "prmppo/ppo/update.py" in kernels.split("== update")[1]


def test_profile_refuses_a_command_without_the_separator(monkeypatch):
    monkeypatch.setattr(sys, "argv", [str(BENCH), "--out", "x"])
    with pytest.raises(SystemExit) as done:
        runpy.run_path(str(BENCH), run_name="__main__")
    assert "--" in str(done.value.code)


def test_kernels_by_phase_sums_each_phases_kernels_on_the_device_timeline():
    profile = runpy.run_path(str(BENCH))
    trace = {"traceEvents": [
        {"cat": "gpu_user_annotation", "name": "phase:assemble", "ts": 100, "dur": 100},
        {"cat": "gpu_user_annotation", "name": "phase:update", "ts": 200, "dur": 300},
        {"cat": "user_annotation", "name": "phase:assemble", "ts": 0, "dur": 10},  # host range: ignored here
        {"cat": "kernel", "name": "sm90_xmma_gemm_bf16", "ts": 110, "dur": 40},
        {"cat": "kernel", "name": "triton_poi_fused_add_0", "ts": 150, "dur": 10},
        {"cat": "kernel", "name": "sm90_xmma_gemm_bf16", "ts": 210, "dur": 60},
        {"cat": "kernel", "name": "cudnn_generated_fort_native_sdpa", "ts": 300, "dur": 20},
        {"cat": "kernel", "name": "late", "ts": 600, "dur": 5},  # after every phase
    ]}
    text = profile["kernels_by_phase"](trace)
    assemble, update = text.split("== update")
    assert "assemble: span 0.000 s, kernels 0.000 s, 2 launches" in assemble
    assert "matmul" in assemble and "80.0%" in assemble and "fused (inductor)" in assemble and "20.0%" in assemble
    assert ": span 0.000 s, kernels 0.000 s, 2 launches" in update and "attention" in update and "late" not in update
    assert "0.1 ms      2x  sm90_xmma_gemm_bf16" not in text  # each phase counts its own launches only
    assert profile["kernel_family"]("triton_poi_fused__scaled_dot_product_cudnn_attention_where_3") == "fused (inductor)"
    assert profile["kernel_family"]("cudnn_generated_fort_native_sdpa_sm90_flash_fprop") == "attention"
    host_only = profile["kernels_by_phase"]({"traceEvents": trace["traceEvents"][2:3] + trace["traceEvents"][3:5]})
    assert "assemble: span 0.000 s, kernels 0.000 s, 2 launches" in host_only  # to the last kernel's end: both


def test_idle_gaps_count_the_device_idle_between_its_work_inside_a_span():
    idle_gaps = runpy.run_path(str(BENCH))["idle_gaps"]
    work = [(0, 50), (40, 120), (300, 320), (330, 600), (900, 950)]  # two streams overlap at 40-50
    idle, gaps = idle_gaps(work, 100, 700)
    assert idle == (300 - 120) + (330 - 320) + (700 - 600)
    assert gaps == [(120, 300)]  # the 10 us gap and the 100 us tail are not over 100 us
    assert idle_gaps([], 0, 500) == (500, [(0, 500)])


def test_host_in_gaps_charges_each_idle_microsecond_to_the_innermost_frame_then_running():
    profile = runpy.run_path(str(BENCH))
    frames = [(0, 1000, "src/prmppo/ppo/assemble.py(120): assemble"),
              (100, 400, "src/prmppo/models/token_scores.py(70): token_scores"),
              (150, 350, "<built-in method nonzero of Tensor object at 0x1>"),
              (600, 700, "torch/_dynamo/eval_frame.py(400): _fn"),
              (1200, 1300, "elsewhere.py(3): other")]
    ours, every = profile["host_in_gaps"](frames, [(100, 300), (500, 800), (1100, 1200)])
    assert ours == {"prmppo/models/token_scores.py(70): token_scores": 200,
                    "prmppo/ppo/assemble.py(120): assemble": 300, "(no prmppo frame)": 100}
    assert every == {"src/prmppo/models/token_scores.py(70): token_scores": 50,
                     "<built-in method nonzero of Tensor object at 0x1>": 150,
                     "src/prmppo/ppo/assemble.py(120): assemble": 200,
                     "torch/_dynamo/eval_frame.py(400): _fn": 100, "(no Python frame)": 100}


def test_kernels_by_phase_reports_each_phases_idle_device_time():
    profile = runpy.run_path(str(BENCH))
    trace = {"traceEvents": [
        {"cat": "gpu_user_annotation", "name": "phase:assemble", "ts": 0, "dur": 1000},
        {"cat": "kernel", "name": "k", "ts": 0, "dur": 100},
        {"cat": "gpu_memcpy", "name": "Memcpy HtoD", "ts": 100, "dur": 100},  # a copy keeps the device busy
        {"cat": "kernel", "name": "k", "ts": 700, "dur": 300},
    ]}
    text = profile["kernels_by_phase"](trace)
    assert "device idle 500.0 ms" not in text and "device idle 0.5 ms of the span; gaps over 100 us: 1, 0.5 ms, the largest 0.5 ms" in text
    assert "the host in those gaps" not in text  # a trace without Python frames
    trace["traceEvents"] += [{"cat": "user_annotation", "name": "phase:assemble", "ts": 0, "dur": 700, "tid": 1},
                             {"cat": "python_function", "name": "src/prmppo/ppo/estimators.py(40): gae", "ts": 150,
                              "dur": 600, "tid": 1},
                             {"cat": "python_function", "name": "src/prmppo/ppo/other.py(1): thread", "ts": 0,
                              "dur": 1000, "tid": 2}]  # another thread's frames are not the phase thread's
    text = profile["kernels_by_phase"](trace)
    host, other = text.split("other threads")
    assert "the host in those gaps, by innermost frame of src/prmppo:\n          0.5 ms  prmppo/ppo/estimators.py(40): gae" in host
    assert "other.py" not in host
    assert " (the autograd engine's) in those gaps, by innermost frame of src/prmppo:\n          0.5 ms  prmppo/ppo/other.py(1): thread" in other


def test_sync_sites_count_each_synchronisation_by_phase_and_line(monkeypatch):
    import warnings

    profile = runpy.run_path(str(BENCH))
    state = {"phase": "assemble"}
    sites = profile["SyncSites"](state)
    monkeypatch.setitem(sites.show.__func__.__globals__, "SRC", str(Path(__file__).parent))  # this file is "ours"
    seen = []
    with warnings.catch_warnings():
        warnings.showwarning = lambda *args, **kwargs: seen.append(str(args[0]))
        with sites.record():
            for _ in range(3):
                warnings.warn("called a synchronizing CUDA operation", UserWarning)
            state["phase"] = "update"
            warnings.warn("called a synchronizing CUDA operation", UserWarning)
            warnings.warn("something else", UserWarning)
    assert seen == ["something else"]  # other warnings go on to the previous handler
    counts = {(phase, count) for (phase, site, _), count in sites.counts.items()}
    assert counts == {("assemble", 3), ("update", 1)}
    assert all("test_iteration_profile.py" in site and "warnings.warn" in site for _, site, _ in sites.counts)
    assert sites.table().startswith("4 synchronisations")
