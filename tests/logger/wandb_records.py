"""Reads back an offline W&B run's `.wandb` file without W&B's servers or `wandb sync`.

The file is a LevelDB-style log: a 7-byte header (`:W&B`, a 2-byte magic, a 1-byte version),
then 32 KiB blocks of records, each `crc32: uint32 LE | length: uint16 LE | type: uint8 | data`
(types FULL=1, FIRST=2, MIDDLE=3, LAST=4 split a payload across blocks; a block's tail shorter
than a record header is zero padding). The crc is zlib's crc32 of the type byte then the data.
Every payload is a `wandb_internal_pb2.Record` protobuf.
"""

from __future__ import annotations

import json
import struct
import zlib
from pathlib import Path

BLOCK = 32768
RECORD_HEADER = 7
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def payloads(path: Path) -> list[bytes]:
    data = path.read_bytes()
    assert data[:4] == b":W&B", f"{path} is not a W&B transaction log"
    out, pending, offset = [], b"", 7
    while offset + RECORD_HEADER <= len(data):
        room = BLOCK - offset % BLOCK
        if room < RECORD_HEADER:  # block trailer
            offset += room
            continue
        crc, length, kind = struct.unpack("<IHB", data[offset:offset + RECORD_HEADER])
        chunk = data[offset + RECORD_HEADER:offset + RECORD_HEADER + length]
        if kind == 0 and length == 0:  # preallocated zeros at the end of the file
            break
        assert zlib.crc32(chunk, zlib.crc32(bytes([kind]))) & 0xFFFFFFFF == crc, f"bad crc at byte {offset}"
        offset += RECORD_HEADER + length
        if kind == FULL:
            out.append(chunk)
        elif kind == FIRST:
            pending = chunk
        elif kind == MIDDLE:
            pending += chunk
        elif kind == LAST:
            out.append(pending + chunk)
            pending = b""
    return out


def read_offline_run(run_dir: Path) -> dict:
    """`{"run": run record fields, "config": {key: value}, "history": [{metric: value}, ...]}`."""
    from wandb.proto import wandb_internal_pb2 as pb

    (wandb_file,) = Path(run_dir).glob("run-*.wandb")
    result: dict = {"run": {}, "config": {}, "history": []}
    for payload in payloads(wandb_file):
        record = pb.Record()
        record.ParseFromString(payload)
        kind = record.WhichOneof("record_type")
        if kind == "run":
            run = record.run
            result["run"] = {"group": run.run_group, "job_type": run.job_type, "tags": list(run.tags),
                             "display_name": run.display_name, "project": run.project}
            updates = run.config.update
        elif kind == "config":
            updates = record.config.update
        elif kind == "history":
            result["history"].append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                                      for item in record.history.item})
            continue
        else:
            continue
        for item in updates:
            result["config"][item.key or "/".join(item.nested_key)] = json.loads(item.value_json)
    return result
