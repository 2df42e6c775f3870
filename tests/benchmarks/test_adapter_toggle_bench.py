"""The adapter-toggle benchmark's smoke run: both sides time an entry and exit of their context and the ratio
prints. (That `adapters_off` leaves the policy as it found it is tested in tests/models/test_policy.py.)"""

from __future__ import annotations

import runpy
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "adapter_toggle_bench.py"


def test_smoke_run_times_both_sides(capsys):
    out = runpy.run_path(str(BENCH))["main"](["--layers", "1", "--repeats", "2", "--rounds", "1"])
    assert set(out) == {"peft disable_adapter", "adapters_off"} and all(ms > 0 for ms in out.values())
    assert "peft / adapters_off:" in capsys.readouterr().out
