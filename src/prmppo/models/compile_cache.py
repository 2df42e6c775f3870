"""A compile cache kept with the artifacts: a run with `ppo.compile=true` whose graphs an earlier run of
the same shapes compiled starts warm, on the same machine or on a fresh one given the artifacts dir.

The cache is torch's portable one ("mega-cache": `torch.compiler.save_cache_artifacts` and
`load_cache_artifacts`): one blob holding what inductor's FX graph cache, AOTAutograd's cache, the
autotuning cache, dynamo's dynamic-shape decisions and (on CUDA) the Triton kernels hold for the graphs
the process compiled or found in its local caches. One file per key, `<artifacts_dir>/compile_cache/
<key>.bin`; the key (`compile_cache_key`) hashes what decides the graphs: the torch, Python, transformers
and peft versions, the device, the compiled model's config and parameter dtype, its adapters' configs
(the policy's LoRA, a PRM's on the same base), and the run's compile-relevant settings (autocast,
gradient checkpointing, ranks). The stage loads the file into the local caches before the first compiled
forward and saves it after the first PPO iteration, by which point every graph of the run is compiled
(ppo/batch.py); a save that would add nothing to what the file holds writes nothing. One save per
process: torch (2.13) appends a second `save_cache_artifacts` blob to the first, and its reader keeps
only the last part of each kind, so a second save would write a file without the first save's graphs.

It changes no number: each artifact is found by inductor's and AOTAutograd's own keys (the graph, the
inductor config, the versions, the device), so what it serves is the code a cold compile of that graph
would have produced, and an artifact whose key does not match is never used. Two runs may share the
directory: a file is written under a temporary name and renamed, so a reader sees a whole file, the old
or the new. A file that is not one of these (a wrong header, a payload whose checksum does not match,
bytes torch cannot read, another key's file) is ignored with a warning and the run compiles cold.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import tempfile
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import torch
from torch import nn

log = logging.getLogger("prmppo")

MAGIC = b"prmppo-compile-cache 1\n"  # the first line of every cache file; the header's JSON line follows
# config keys that name a location, not a shape: runs from two SFT artifacts of one shape share graphs
_PATH_KEYS = ("_name_or_path", "name_or_path", "base_model_name_or_path", "revision", "transformers_version")


def _version(package: str) -> str | None:
    try:
        return version(package)
    except PackageNotFoundError:
        return None


def _device_key(device: torch.device) -> dict:
    """The device as inductor's code depends on it: the GPU's name, capability and CUDA version; the CPU's
    architecture and vector ISA."""
    if device.type == "cuda":
        return {"type": "cuda", "name": torch.cuda.get_device_name(device),
                "capability": list(torch.cuda.get_device_capability(device)), "cuda": torch.version.cuda,
                "triton": _version("triton")}
    return {"type": device.type, "machine": platform.machine(), "isa": torch.backends.cpu.get_cpu_capability()}


def _without_paths(value):
    """`value` (a config dict) with every location key dropped, sets made sorted lists (JSON has no sets)."""
    if isinstance(value, dict):
        return {k: _without_paths(v) for k, v in value.items() if k not in _PATH_KEYS}
    if isinstance(value, (list, tuple)):
        return [_without_paths(v) for v in value]
    if isinstance(value, (set, frozenset)):
        return sorted(_without_paths(v) for v in value)
    return value


def compile_cache_key(model: nn.Module, device: torch.device, **settings) -> str:
    """16 hex digits naming the graphs `model` compiles on `device` under `settings` (JSON-able run settings
    that change a graph: autocast, gradient checkpointing, world size). `model`: the compiled model, a peft
    model or a transformers one; its adapters (peft's `peft_config`, one entry per adapter) count."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    adapters = {name: config.to_dict() for name, config in getattr(model, "peft_config", {}).items()}
    parts = {"torch": torch.__version__, "python": platform.python_version(),
             "transformers": _version("transformers"), "peft": _version("peft"), "device": _device_key(device),
             "model": _without_paths(base.config.to_dict()), "adapters": _without_paths(adapters),
             "dtypes": sorted({str(p.dtype) for p in model.parameters()}), "settings": settings}
    blob = json.dumps(parts, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


class CompileCache:
    """The cache file of one key: `load` before the first compiled forward, `save` once the graphs exist."""

    def __init__(self, directory: Path, key: str):
        self.key = key
        self.path = Path(directory) / f"{key}.bin"
        self.loaded: dict[str, int] = {}  # artifacts loaded, per kind (inductor, aot_autograd, ...)
        self._in_file: set[tuple[str, str]] = set()  # (kind, key) of the artifacts loaded from the file
        self._saved = False

    def load(self) -> bool:
        """Put the file's artifacts into this process's compile caches; False (with a warning when the file
        exists but is unusable) when there is nothing to load."""
        if not self.path.is_file():
            log.info("compile cache: none at %s yet; this run compiles cold and saves one", self.path)
            return False
        try:
            payload = self._read_payload()
            info = torch.compiler.load_cache_artifacts(payload)
            if info is None:  # torch logs why it could not read the bytes
                raise ValueError("torch could not read its artifacts (another torch version's format?)")
        except Exception as error:  # noqa: BLE001 - any unusable file means a cold compile, never a failed run
            log.warning("compile cache: ignoring %s (%s); compiling cold", self.path, error)
            return False
        self._in_file = {(kind, key) for kind, keys in info.artifacts.items() for key in keys}
        self.loaded = {kind: len(keys) for kind, keys in info.artifacts.items()}
        log.info("compile cache: loaded %s from %s", self.loaded, self.path)
        return True

    def _read_payload(self) -> bytes:
        """The payload of the file, after its header is checked: the magic line, this key, the checksum."""
        data = self.path.read_bytes()
        if not data.startswith(MAGIC):
            raise ValueError("not a prmppo compile cache file (no header)")
        header_line, _, payload = data[len(MAGIC):].partition(b"\n")
        header = json.loads(header_line)
        if header.get("key") != self.key:
            raise ValueError(f"made for key {header.get('key')!r}, not {self.key!r}")
        if hashlib.sha256(payload).hexdigest() != header.get("sha256"):
            raise ValueError(f"its payload ({len(payload)} bytes) does not match its checksum: a damaged file")
        return payload

    def save(self) -> bool:
        """Write every artifact this process compiled or used, unless they all came from the file; True when
        the file was written. Written atomically (a temp file in the same directory, renamed). Once per
        process (the module docstring says why): a later call writes nothing."""
        if self._saved:
            log.info("compile cache: saved once by this process already; graphs compiled since are not kept")
            return False
        self._saved = True
        saved = torch.compiler.save_cache_artifacts()
        if saved is None:
            log.info("compile cache: nothing compiled, nothing to save")
            return False
        payload, info = saved
        keys = {(kind, key) for kind, kinds in info.artifacts.items() for key in kinds}
        if keys <= self._in_file:
            log.info("compile cache: %s holds every artifact already; left as it is", self.path)
            return False
        header = json.dumps({"key": self.key, "sha256": hashlib.sha256(payload).hexdigest(),
                             "torch": torch.__version__}).encode()
        try:
            self._write(MAGIC + header + b"\n" + payload)
        except OSError as error:  # a cache that cannot be written costs the next run a cold compile, no more
            log.warning("compile cache: could not write %s (%s); the next run compiles cold", self.path, error)
            return False
        log.info("compile cache: saved %d artifacts (%d bytes) to %s", len(keys), len(payload), self.path)
        return True

    def _write(self, data: bytes) -> None:
        """`data` to the file through a uniquely named temp file beside it, renamed over it once complete:
        a run reading the file meanwhile sees the old file or the new one, whole."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        handle, temp = tempfile.mkstemp(dir=self.path.parent, prefix=f".{self.path.name}.", suffix=".tmp")
        try:
            with os.fdopen(handle, "wb") as out:
                os.fchmod(out.fileno(), 0o644)  # mkstemp's 0600 would keep other users' runs from reading it
                out.write(data)
                out.flush()
                os.fsync(out.fileno())
            os.replace(temp, self.path)
        except BaseException:
            Path(temp).unlink(missing_ok=True)
            raise


def cache_counters() -> dict[str, int]:
    """This process's compile-cache hits, misses and bypasses so far (inductor's FX graph cache, AOTAutograd's
    cache): a warm start shows FX graph hits and no FX graph misses (AOTAutograd may still miss a graph it does
    not cache); a bypass is a graph the cache would not take at all, which every run compiles cold."""
    from torch._dynamo.utils import counters

    return {name: int(counters[group][name]) for group, names in
            (("inductor", ("fxgraph_cache_hit", "fxgraph_cache_miss", "fxgraph_cache_bypass")),
             ("aot_autograd", ("autograd_cache_hit", "autograd_cache_miss", "autograd_cache_bypass")))
            for name in names}
