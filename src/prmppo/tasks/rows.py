"""Rows of a data file (JSONL or Parquet) with where each came from, and fields picked by dotted paths.

`read_rows(path)` yields `(where, row)`: `where` names the file and the line (JSONL, 1-based, blank
lines skipped) or the row (Parquet, 1-based), so that a refusal points at the row to fix. Parquet is
read through pyarrow, whole, into Python dicts (verl's files hold nested structs and lists of
messages, which come back as dicts and lists).

`field(row, "reward_model.ground_truth")` walks nested dicts; a missing step raises `KeyError` with the
dotted prefix that is missing.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator

from prmppo.errors import DataError, DataFileMissing

JSONL_SUFFIXES = (".jsonl", ".json")
PARQUET_SUFFIXES = (".parquet", ".pq")


def _jsonl_rows(path: Path) -> Iterator[tuple[str, object]]:
    with path.open(encoding="utf-8") as handle:
        for line_no, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                yield f"{path}: line {line_no}", json.loads(line)
            except json.JSONDecodeError as error:
                raise DataError(f"{path}: line {line_no}: bad JSON ({error.msg} at column {error.colno})") from None


def _parquet_rows(path: Path) -> Iterator[tuple[str, object]]:
    import pyarrow.parquet as pq  # imported here: only Parquet files need it

    try:
        table = pq.read_table(path)
    except Exception as error:  # pyarrow raises its own ArrowInvalid / OSError family
        raise DataError(f"{path}: not a readable Parquet file ({error})") from None
    for row_no, row in enumerate(table.to_pylist(), start=1):
        yield f"{path}: row {row_no}", row


def read_rows(path: Path, key: str) -> Iterator[tuple[str, object]]:
    """`(where, row)` for every row of the JSONL or Parquet file at `path`; `key` is the config key that
    named the file (for the message when it is missing or of an unknown kind)."""
    if not path.is_file():
        raise DataFileMissing(f"{key}={str(path)!r}: no such file")
    suffix = path.suffix.lower()
    if suffix in JSONL_SUFFIXES:
        return _jsonl_rows(path)
    if suffix in PARQUET_SUFFIXES:
        return _parquet_rows(path)
    raise DataError(f"{key}={str(path)!r}: unknown file kind {suffix!r}; use JSON lines "
                    f"({', '.join(JSONL_SUFFIXES)}) or Parquet ({', '.join(PARQUET_SUFFIXES)})")


def field(row: object, dotted: str):
    """The value at `dotted` ("a.b.c") inside nested dicts; KeyError(prefix) when a step is missing."""
    value, walked = row, []
    for part in dotted.split("."):
        walked.append(part)
        if not isinstance(value, dict) or part not in value or value[part] is None:
            raise KeyError(".".join(walked))
        value = value[part]
    return value
