"""Start-up laps: counted from the process's start for its first job, from the job's own start after
that (a sweep launcher's worker process runs several jobs one after another)."""

from __future__ import annotations

import time

from prmppo.logger import laps


def test_a_later_job_in_the_same_process_counts_its_start_up_from_its_own_start(monkeypatch):
    monkeypatch.setattr(laps, "_jobs", {"count": 0, "latest": None})
    monkeypatch.setattr(laps, "process_start_time", lambda: time.time() - 500.0)  # a worker started long ago
    laps.job_started()
    first = laps.Laps()
    with first.lap("policy"):
        pass
    assert first.as_dict()["before_first_lap"] >= 499.0  # the first job: imports etc. since the process began

    laps.job_started()  # the worker's next job
    time.sleep(0.05)
    second = laps.Laps()
    with second.lap("policy"):
        pass
    timed = second.as_dict()
    assert 0.04 <= timed["before_first_lap"] < 5.0, timed  # not the 500 s the process has lived
    assert timed["total"] < 5.0
