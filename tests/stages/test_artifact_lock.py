"""Two runs that need the same artifact at once (the jobs of a parallel sweep sharing a seed): one
builds it while the other waits for the build lock and then reuses it, instead of both training into
one staging directory."""

from __future__ import annotations

import multiprocessing as mp
from pathlib import Path

import pytest

from prmppo import artifacts
from prmppo.stages.sft_training import ensure_sft
from prmppo.config.build import build


def _ensure(cfg, run_dir: str, start, results) -> None:
    start.wait()  # both processes ask for the artifact at the same moment
    try:
        _, summary = ensure_sft(cfg, build(cfg.task, "task"), Path(run_dir), reuse=True)
        results.put(("ok", bool(summary.get("reused"))))
    except Exception as exc:  # noqa: BLE001 - the parent asserts on it
        results.put(("error", repr(exc)))


@pytest.mark.slow  # concurrent smoke runs racing for one artifact
def test_concurrent_runs_build_the_sft_artifact_once(smoke_cfg, tmp_path):
    cfg = smoke_cfg("stage=sft")
    ctx = mp.get_context("spawn")  # fresh interpreters: forking a process whose torch thread pool is live can crash
    start, results = ctx.Barrier(2), ctx.Queue()
    procs = [ctx.Process(target=_ensure, args=(cfg, str(tmp_path / f"run{i}"), start, results)) for i in range(2)]
    for p in procs:
        p.start()
    outcomes = sorted(results.get(timeout=300) for _ in procs)
    for p in procs:
        p.join(timeout=60)
    assert outcomes == [("ok", False), ("ok", True)], outcomes  # one trained, one reused
    final = artifacts.artifact_dir(cfg, "sft")
    assert artifacts.artifact_ready(final)
    leftovers = sorted(p.name for p in final.parent.iterdir() if p.name != final.name)
    assert leftovers == [".locks"], leftovers  # no staging dir left behind; the lock apart from the artifacts
    assert [p.name for p in (final.parent / ".locks").iterdir()] == [final.name + ".lock"]
