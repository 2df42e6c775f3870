"""Weights shared in memory between the trainer and the built-in engine (`rollout.sync=shared`).

The trainer keeps one flat byte buffer that holds every tensor of the merged policy (base names,
as a merged checkpoint would hold them) and a version stamp after them; each sync writes the
merged weights and then the stamp into it. The engine maps the same buffer once and, on each
sync, copies from it into its resident tensors in place (the static decoder's CUDA graphs keep
their storage). No file is serialised and nothing goes through a disk.

Where the buffer lives follows the weights the trainer hands over:

- CUDA tensors: a CUDA allocation of the trainer's, opened by the engine through a CUDA IPC
  handle (`transport: cuda_ipc`); the copy into the engine's weights runs on the device;
- CPU tensors (the CPU topology, or the full copy rank 0 gathers under FSDP): a file in
  `/dev/shm` (in the sync directory where `/dev/shm` is missing or has less than twice the
  buffer's size free) that both processes map
  (`transport: shm`); a CUDA engine copies from it to the device.

`manifest.json` (in the sync directory's `shared/`) describes the buffer: its transport and
handle, its size, the stamp's offset, and each tensor (its names: tied weights share one
entry; dtype; shape; byte offset). It is written once, when the buffer is made; the engine
re-opens the buffer when the manifest's `buffer_id` changes. The stamp is what makes a stale
read visible: the engine checks that the buffer holds the version the request names, before and
after its copy, and refuses to serve otherwise.

Ordering: the trainer finishes its writes (a device synchronize for CUDA) before it writes the
request that names the new version, so the engine, which reads only after that request, sees
complete weights. The trainer owns the buffer and removes the `/dev/shm` file when the sync
object goes away; a file whose owner was killed (SIGKILL leaves it) is removed by the next writer
made on the machine (`prmppo-weights-<pid>-*` names the owner, which must no longer run).
"""

from __future__ import annotations

import json
import os
import uuid
import weakref
from pathlib import Path

import torch

MANIFEST = "manifest.json"
ALIGN = 256  # bytes: every tensor starts on this boundary, so any dtype can view its slice
DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float64: "float64",
               torch.int64: "int64", torch.int32: "int32", torch.uint8: "uint8", torch.bool: "bool"}
DTYPES = {name: dtype for dtype, name in DTYPE_NAMES.items()}
SHM_DIR = Path("/dev/shm")


def _aligned(offset: int) -> int:
    return -(-offset // ALIGN) * ALIGN


def _view(buffer: torch.Tensor, entry: dict) -> torch.Tensor:
    dtype = DTYPES[entry["dtype"]]
    count = 1
    for size in entry["shape"]:
        count *= size
    nbytes = count * torch.empty((), dtype=dtype).element_size()
    start = entry["offset"]
    return buffer[start:start + nbytes].view(dtype).view(entry["shape"])


def _stamp_view(buffer: torch.Tensor, offset: int) -> torch.Tensor:
    return buffer[offset:offset + 8].view(torch.int64)


def remove_orphaned_files(where: Path = SHM_DIR) -> list[Path]:
    """Remove `prmppo-weights-<pid>-*.bin` files in `where` whose owner process no longer runs; returns them."""
    removed = []
    for path in where.glob("prmppo-weights-*-*.bin") if where.is_dir() else []:
        try:
            os.kill(int(path.name.split("-")[2]), 0)
        except ProcessLookupError:  # the owner is gone
            _unlink(path)
            removed.append(path)
        except (ValueError, PermissionError):  # not a pid, or another user's live process
            continue
    return removed


class SharedWeightsWriter:
    """The trainer's side: a buffer made on the first `write`, rewritten in place on each later one."""

    def __init__(self, directory: Path):
        remove_orphaned_files()
        self.directory = Path(directory)
        self.buffer: torch.Tensor | None = None
        self.manifest: dict | None = None
        self._shm_file: Path | None = None
        self._finalizer = None

    @property
    def path(self) -> Path:
        return self.directory

    def _layout(self, state: dict[str, torch.Tensor]) -> tuple[list[dict], int, list[torch.Tensor]]:
        """One entry per distinct tensor (tied names together), in `state`'s order; (entries, stamp offset,
        the source tensor of each entry)."""
        entries, sources, by_storage = [], [], {}
        offset = 0
        for name, tensor in state.items():
            if tensor.dtype not in DTYPE_NAMES:
                raise ValueError(f"rollout.sync=shared cannot carry {name} of dtype {tensor.dtype}")
            key = (tensor.device, tensor.data_ptr(), tuple(tensor.shape), tensor.dtype)
            if tensor.numel() and key in by_storage:
                entries[by_storage[key]]["names"].append(name)
                continue
            offset = _aligned(offset)
            by_storage[key] = len(entries)
            entries.append({"names": [name], "dtype": DTYPE_NAMES[tensor.dtype], "shape": list(tensor.shape),
                            "offset": offset})
            sources.append(tensor)
            offset += tensor.numel() * tensor.element_size()
        return entries, _aligned(offset), sources

    def _make_buffer(self, entries: list[dict], stamp_offset: int, device: torch.device) -> None:
        size = stamp_offset + 8
        buffer_id = uuid.uuid4().hex
        self.directory.mkdir(parents=True, exist_ok=True)
        manifest = {"buffer_id": buffer_id, "size": size, "stamp_offset": stamp_offset, "tensors": entries}
        if device.type == "cuda":
            self.buffer = torch.zeros(size, dtype=torch.uint8, device=device)
            manifest.update(transport="cuda_ipc", handle=cuda_ipc_handle(self.buffer))
        elif device.type == "cpu":
            where = SHM_DIR if _room_for(SHM_DIR, size) else self.directory  # a small /dev/shm (a container's
            # 64 MB) would take the pages and then fault when they are written: the run's own directory instead
            self._shm_file = where / f"prmppo-weights-{os.getpid()}-{buffer_id[:12]}.bin"
            self.buffer = torch.from_file(str(self._shm_file), shared=True, size=size, dtype=torch.uint8)
            self._finalizer = weakref.finalize(self, _unlink, self._shm_file)
            manifest.update(transport="shm", file=str(self._shm_file))
        else:
            raise ValueError(f"rollout.sync=shared: the weights are on {device}, which has no shared transport "
                             "(cuda or cpu); use rollout.sync=checkpoint")
        _stamp_view(self.buffer, stamp_offset).fill_(-1)  # no version is in it yet
        tmp = self.directory / (MANIFEST + ".partial")
        tmp.write_text(json.dumps(manifest))
        tmp.rename(self.directory / MANIFEST)
        self.manifest = manifest

    def write(self, state: dict[str, torch.Tensor], version: int) -> Path:
        """Put `state` (name -> tensor, one device) and `version` into the buffer; returns the directory
        the engine is pointed at. The layout is fixed by the first call; a later `state` must match it."""
        entries, stamp_offset, sources = self._layout(state)
        devices = {tensor.device for tensor in sources}
        if len(devices) != 1:
            raise ValueError("rollout.sync=shared: the merged weights span several devices "
                             f"{sorted(map(str, devices))}")
        if self.manifest is None:
            self._make_buffer(entries, stamp_offset, devices.pop())
        elif entries != self.manifest["tensors"]:
            raise ValueError("rollout.sync=shared: the policy's tensors changed names, shapes or dtypes since the "
                             "buffer was made")
        with torch.no_grad():
            stamp = _stamp_view(self.buffer, self.manifest["stamp_offset"])
            stamp.fill_(-1)  # a reader between here and the end sees no complete version
            for entry, tensor in zip(self.manifest["tensors"], sources):
                _view(self.buffer, entry).copy_(tensor)
            stamp.fill_(version)
        if self.buffer.is_cuda:
            torch.cuda.synchronize(self.buffer.device)
        return self.directory

    def close(self) -> None:
        self.buffer = None
        if self._finalizer is not None:
            self._finalizer()


def _room_for(where: Path, size: int) -> bool:
    """Whether `where` is a writable directory with `size` bytes free and a margin beside them."""
    if not (where.is_dir() and os.access(where, os.W_OK)):
        return False
    stats = os.statvfs(where)
    return stats.f_bavail * stats.f_frsize >= 2 * size


def _unlink(path: Path) -> None:
    try:
        path.unlink()
    except FileNotFoundError:
        pass


def cuda_ipc_handle(buffer: torch.Tensor) -> dict:
    """The fields another process needs to open `buffer` (a whole CUDA allocation of its own storage),
    as JSON: torch's own IPC reduction, its byte strings in hex."""
    from torch.multiprocessing.reductions import reduce_tensor

    _, args = reduce_tensor(buffer)
    (_, _, _, _, _, _, device, handle, size_bytes, offset_bytes, _, ref_handle, ref_offset, event_handle,
     event_sync) = args
    return {"device": device, "handle": handle.hex(), "size_bytes": size_bytes, "offset_bytes": offset_bytes,
            "ref_counter_handle": ref_handle.hex(), "ref_counter_offset": ref_offset,
            "event_handle": event_handle.hex() if event_handle else None, "event_sync_required": event_sync}


def open_cuda_ipc(handle: dict, size: int) -> torch.Tensor:
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    return rebuild_cuda_tensor(
        torch.Tensor, (size,), (1,), 0, torch.storage.TypedStorage, torch.uint8, handle["device"],
        bytes.fromhex(handle["handle"]), handle["size_bytes"], handle["offset_bytes"], False,
        bytes.fromhex(handle["ref_counter_handle"]), handle["ref_counter_offset"],
        bytes.fromhex(handle["event_handle"]) if handle["event_handle"] else None, handle["event_sync_required"])


class SharedWeightsReader:
    """The engine's side: opens the buffer a manifest names (once per buffer) and copies a version out."""

    def __init__(self):
        self._buffer_id: str | None = None
        self._buffer: torch.Tensor | None = None
        self._manifest: dict | None = None

    def _open(self, directory: Path) -> dict:
        path = Path(directory) / MANIFEST
        if not path.is_file():
            raise FileNotFoundError(f"shared weights dir {str(directory)!r} has no {MANIFEST}")
        manifest = json.loads(path.read_text())
        missing = {"buffer_id", "size", "stamp_offset", "tensors", "transport"} - manifest.keys()
        if missing:
            raise ValueError(f"{path} lacks {sorted(missing)}")
        if manifest["buffer_id"] != self._buffer_id:
            self._buffer = None
            if manifest["transport"] == "cuda_ipc":
                self._buffer = open_cuda_ipc(manifest["handle"], manifest["size"])
            elif manifest["transport"] == "shm":
                file = Path(manifest["file"])
                if not file.is_file() or file.stat().st_size < manifest["size"]:
                    raise FileNotFoundError(f"shared weights file {file} is missing or shorter than "
                                            f"{manifest['size']} bytes (did the trainer exit?)")
                self._buffer = torch.from_file(str(file), shared=True, size=manifest["size"], dtype=torch.uint8)
            else:
                raise ValueError(f"{path}: transport={manifest['transport']!r} is not cuda_ipc or shm")
            self._buffer_id, self._manifest = manifest["buffer_id"], manifest
        return self._manifest

    def _stamp(self) -> int:
        return int(_stamp_view(self._buffer, self._manifest["stamp_offset"]).item())

    def copy_into(self, model: torch.nn.Module, directory: Path, version: int) -> None:
        """Copy the buffer's weights into `model`'s tensors (matched by name); raises, copying nothing, when
        a name or shape does not match or the buffer does not hold `version`."""
        manifest = self._open(directory)
        targets = model.state_dict(keep_vars=True)  # tied weights appear under each of their names
        covered, pairs = set(), []
        for entry in manifest["tensors"]:
            for name in entry["names"]:
                target = targets.get(name)
                if target is None:
                    raise ValueError(f"shared weights name {name!r}, which the engine's model does not have")
                if list(target.shape) != entry["shape"]:
                    raise ValueError(f"shared weights {name!r} has shape {entry['shape']}, the engine's model "
                                     f"{list(target.shape)}")
                covered.add(id(target))
                pairs.append((target, entry))
        missing = [name for name, parameter in model.named_parameters() if id(parameter) not in covered]
        if missing:
            raise ValueError(f"shared weights lack {len(missing)} of the engine's parameters, e.g. {missing[:3]}")
        if self._stamp() != version:
            raise RuntimeError(f"the shared weights buffer holds version {self._stamp()}, the request asks for "
                               f"{version}: the trainer has not finished writing it")
        with torch.no_grad():
            for target, entry in pairs:
                target.copy_(_view(self._buffer, entry))
        for device in {target.device for target, _ in pairs if target.is_cuda} | (
                {self._buffer.device} if self._buffer.is_cuda else set()):
            torch.cuda.synchronize(device)  # the copies are done before the stamp is read again
        if self._stamp() != version:  # the trainer rewrote it while this copy ran
            raise RuntimeError(f"the shared weights buffer moved from version {version} to {self._stamp()} "
                               "during the copy")
