"""Where a stage's start-up time goes: named laps, and how long the process ran before the first.

    laps = Laps()
    with laps.lap("policy"):
        policy = build_policy(...)
    banner["startup_s"] = laps.as_dict()

`as_dict()` holds each lap's seconds, `before_first_lap` (from the process's start, as the OS
records it, to the first lap: interpreter start, imports, config composition, the stage's earlier
work) and `total` (from the process's start to the end of the last lap). A process that runs several
jobs one after another (a sweep launcher's reused worker) counts each later job's start-up from that
job's start (`job_started`, called by `app.run`), not from the process's.
"""

from __future__ import annotations

import os
import time
from contextlib import contextmanager
from pathlib import Path


_jobs = {"count": 0, "latest": None}


def job_started() -> None:
    """Record that a job begins in this process (`app.run`); from the second job on, start-up counts from it."""
    _jobs["count"] += 1
    _jobs["latest"] = time.time()


def startup_origin() -> float | None:
    """When this job's start-up began: the process's start for its first job, the job's start after that."""
    if _jobs["count"] > 1:
        return _jobs["latest"]
    return process_start_time()


def process_start_time() -> float | None:
    """The wall-clock time (`time.time()` scale) this process started, from /proc; None where there is none."""
    try:
        fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
        boot = next(float(line.split()[1]) for line in Path("/proc/stat").read_text().splitlines()
                    if line.startswith("btime "))
        return boot + int(fields[19]) / os.sysconf("SC_CLK_TCK")  # field 22 of stat: start time in ticks
    except (OSError, IndexError, ValueError, StopIteration):
        return None


class Laps:
    """Named wall-clock laps of a stage's start-up, in the order they ran."""

    def __init__(self) -> None:
        self._laps: dict[str, float] = {}
        self._first_start: float | None = None
        self._last_end: float | None = None

    @contextmanager
    def lap(self, name: str):
        if name in self._laps:
            raise ValueError(f"lap {name!r} was already timed")
        start = time.time()
        if self._first_start is None:
            self._first_start = start
        try:
            yield
        finally:
            self._last_end = time.time()
            self._laps[name] = self._last_end - start

    def as_dict(self) -> dict[str, float]:
        """{lap: seconds, ..., "before_first_lap": s or None, "total": s from the start-up's origin (or first lap)}."""
        if self._first_start is None:
            return {}
        started = startup_origin()
        before = None if started is None else max(self._first_start - started, 0.0)
        total = self._last_end - (started if started is not None else self._first_start)
        return {**{name: round(s, 3) for name, s in self._laps.items()},
                "before_first_lap": None if before is None else round(before, 3), "total": round(total, 3)}
