"""`MetricsLogger`: one JSON object per line in `<run_dir>/metrics.jsonl`, plus optional sinks.

JSONL is always written and flushed line by line, so a killed run keeps every metric it logged
and reports read the same file whatever else is configured. Console output is one short line
per `log(..., echo=True)` call when `console` is on; sinks (e.g. `WandbSink`, `logger=wandb`)
receive every row after it is on disk and are closed with the logger.
"""

from __future__ import annotations

import json
import math
import os
import sys
import tempfile
import time
from pathlib import Path
from collections.abc import Sequence
from typing import Any


def write_json_atomic(path: str | Path, obj: Any, indent: int | None = 2) -> None:
    """Write JSON to a temp file beside `path`, fsync, then rename over it: never half a file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as handle:
            json.dump(obj, handle, indent=indent, sort_keys=True, default=_jsonable)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _jsonable(value: Any):
    if hasattr(value, "item"):
        return value.item()
    if isinstance(value, Path):
        return str(value)
    raise TypeError(f"cannot write {type(value).__name__} to JSON")


def _clean(value: Any) -> Any:
    value = value.item() if hasattr(value, "item") else value
    if isinstance(value, float) and not math.isfinite(value):
        return None if math.isnan(value) else (1e308 if value > 0 else -1e308)
    return value


class MetricsLogger:
    """Appends `{"stage", "step", "time", **metrics}` lines to `<run_dir>/metrics.jsonl`."""

    def __init__(self, run_dir: str | Path, stage: str, console: bool = True, filename: str = "metrics.jsonl",
                 sinks: Sequence[Any] = ()):
        self.path = Path(run_dir) / filename
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.stage = stage
        self.console = console
        self.sinks = list(sinks)  # objects with log(step, row) and close()
        self._start = time.time()
        self._handle = open(self.path, "a")

    def log(self, step: int, metrics: dict[str, Any], echo: bool = False, stage: str | None = None) -> None:
        """Append one row; `stage` labels it differently from the logger's own stage (e.g. `ppo_eval`)."""
        row = {"stage": stage or self.stage, "step": step, "time": round(time.time() - self._start, 3)}
        row.update({key: _clean(value) for key, value in metrics.items()})
        self._handle.write(json.dumps(row) + "\n")
        self._handle.flush()
        for sink in self.sinks:
            sink.log(step, row)
        if echo and self.console:
            shown = " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                             for k, v in row.items() if k not in ("stage", "time"))
            print(f"[{self.stage}] {shown}", file=sys.stderr, flush=True)

    def close(self) -> None:
        self._handle.close()
        for sink in self.sinks:
            sink.close()

    def __enter__(self) -> "MetricsLogger":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class DiscardMetrics:
    """The metrics logger of a training rank other than 0 (rank 0 alone writes metrics.jsonl and W&B)."""

    console = False  # progress bars and milestones are rank 0's

    def log(self, step: int, metrics: dict[str, Any], echo: bool = False, stage: str | None = None) -> None:
        return None

    def close(self) -> None:
        return None

    def __enter__(self) -> "DiscardMetrics":
        return self

    def __exit__(self, *exc) -> None:
        return None
