"""The rollout worker process: serves rollout requests from a file spool.

    python -m prmppo.rollout.worker --spool DIR --engine hf --base-model DIR \
        [--device cpu] [--dtype float32] [--engine-options JSON] [--heartbeat-interval 1.0] [--poll-interval 0.02]

The trainer normally starts it through `RolloutClient`, which redirects stderr to a log file.
What it does:

1. start a heartbeat thread that rewrites `<spool>/heartbeat.json` every interval
   ({schema_version, pid, time, status, weights}); status "starting";
2. build the engine named by `--engine` (see ENGINE_CLASSES), status "ready"; when it cannot be
   built, status "failed" with a one-line `error` naming the cause (the engine's package is not
   importable, out of memory, or the exception's first line) and exit 1;
3. loop: take the oldest request file, load weights when the request's `WeightsSpec` differs
   from the served one, generate, write the result atomically, delete the request. A corrupt
   request or a failing generation becomes an error result (`{"request_id", "error"}`) instead
   of killing the worker; a `ShutdownRequest` exits 0.

Exit codes: 0 after a shutdown request, 1 when the engine cannot be built, 3 when the parent
(the trainer) is gone, 2 for bad command-line arguments.

The engine seam: an engine is any class with `__init__(base_model_dir, device, dtype, **options)`
(`--engine-options`, a JSON object, gives the options), `load_weights(WeightsSpec)`, a
`served_weights` property and `generate(...)` with the arguments of `RolloutRequest` (see
`hf_engine.HFEngine`, `vllm_engine.VLLMEngine`). Adding one means one entry in ENGINE_CLASSES;
classes are imported lazily so that an engine's heavy dependencies are only needed in the
interpreter that runs it. This module and the protocol import only the standard library, so the
worker runs in an engine environment where prmppo is not installed (PYTHONPATH points at a folder holding only a `prmppo` link).
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import os
import sys
import threading
import time
import traceback
from dataclasses import asdict
from pathlib import Path
from types import MappingProxyType

from prmppo.rollout.protocol import (
    HEARTBEAT_STATUSES,
    ErrorResult,
    RolloutRequest,
    RolloutResult,
    ShutdownRequest,
    SpoolFileError,
    SpoolPaths,
    WeightsSpec,
    read_request,
    validate_request_id,
    write_json_atomic,
)

LOG = logging.getLogger("prmppo.rollout.worker")

# engine name -> "module:Class", imported only when chosen
ENGINE_CLASSES = MappingProxyType({"hf": "prmppo.rollout.hf_engine:HFEngine",
                                   "vllm": "prmppo.rollout.vllm_engine:VLLMEngine"})
# engine name -> the packages its interpreter must import (what the trainer's launch check probes)
ENGINE_PACKAGES = MappingProxyType({"hf": ("torch", "transformers", "peft"), "vllm": ("vllm",)})
EXIT_SHUTDOWN, EXIT_ENGINE_FAILED, EXIT_ORPHANED = 0, 1, 3


def build_engine(name: str, base_model_dir: str, device: str, dtype: str, options: dict | None = None):
    """Import and construct the engine registered under `name`; `options` are its extra keyword arguments."""
    if name not in ENGINE_CLASSES:
        raise ValueError(f"engine={name!r} is unknown; valid: {sorted(ENGINE_CLASSES)}")
    module_name, class_name = ENGINE_CLASSES[name].split(":")
    engine_class = getattr(importlib.import_module(module_name), class_name)
    return engine_class(base_model_dir=base_model_dir, device=device, dtype=dtype, **(options or {}))


def startup_cause(engine: str, err: BaseException) -> str:
    """One line saying why engine `engine` could not be built, for the heartbeat and the trainer's error."""
    text = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    if isinstance(err, ImportError):
        return f"{sys.executable} cannot import what engine {engine!r} needs: {text}"
    if isinstance(err, MemoryError) or type(err).__name__ == "OutOfMemoryError":
        return f"out of memory: {text}"
    return f"{type(err).__name__}: {text}"


class Heartbeat:
    """Background thread rewriting the heartbeat file; status changes are written at once."""

    def __init__(self, path: Path, interval_s: float) -> None:
        self.path = path
        self.interval_s = interval_s
        self._status = "starting"
        self._weights: WeightsSpec | None = None
        self._error: str | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="heartbeat", daemon=True)

    def start(self) -> None:
        self._write()
        self._thread.start()

    def update(self, status: str, weights: WeightsSpec | None, error: str | None = None) -> None:
        """Set what the heartbeat reports; `error` is the one-line cause of status "failed"."""
        if status not in HEARTBEAT_STATUSES:
            raise ValueError(f"heartbeat status={status!r} is invalid; valid: {HEARTBEAT_STATUSES}")
        with self._lock:
            self._status, self._weights, self._error = status, weights, error
        self._write()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5 * self.interval_s + 1)

    def _write(self) -> None:
        with self._lock:  # one writer at a time: the loop thread and the heartbeat thread
            weights = None if self._weights is None else asdict(self._weights)
            beat = {"pid": os.getpid(), "time": time.time(), "status": self._status, "weights": weights}
            if self._error is not None:
                beat["error"] = self._error
            write_json_atomic(self.path, beat)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self._write()
            except OSError as err:  # a full disk must not kill the thread silently forever
                LOG.error("heartbeat write to %s failed: %s", self.path, err)


def _write_error(spool: SpoolPaths, request_id: str, message: str) -> None:
    LOG.error("request %s failed: %s", request_id, message)
    write_json_atomic(spool.result(request_id), ErrorResult(request_id, message).to_dict())


def _serve(engine, request: RolloutRequest, spool: SpoolPaths, heartbeat: Heartbeat) -> None:
    """Load weights if needed, generate, write the result; errors become an error result."""
    heartbeat.update("busy", engine.served_weights)
    try:
        start = time.perf_counter()
        if request.weights != engine.served_weights:
            LOG.info("request %s: loading weights %s", request.request_id, request.weights)
            engine.load_weights(request.weights)
        load_seconds = time.perf_counter() - start
        start = time.perf_counter()
        token_ids, logprobs, finish_reasons = engine.generate(
            prompt_token_ids=request.prompt_token_ids,
            n_samples_per_prompt=request.n_samples_per_prompt,
            max_new_tokens=request.max_new_tokens,
            temperature=request.temperature,
            top_p=request.top_p,
            seed=request.seed,
            eos_token_id=request.eos_token_id,
            pad_token_id=request.pad_token_id,
        )
        seconds = time.perf_counter() - start
        result = RolloutResult(
            request.request_id, engine.served_weights, token_ids, logprobs, finish_reasons, seconds, load_seconds
        )
        write_json_atomic(spool.result(request.request_id), result.to_dict())
        LOG.info("request %s: %d rows in %.2fs (weights loaded in %.3fs)", request.request_id, len(token_ids),
                 seconds, load_seconds)
    except Exception:  # noqa: BLE001 - reported to the client with the traceback
        _write_error(spool, request.request_id, traceback.format_exc())
    finally:
        heartbeat.update("ready", engine.served_weights)


def _handle(path: Path, engine, spool: SpoolPaths, heartbeat: Heartbeat) -> bool:
    """Handle one request file; returns True for a shutdown request."""
    try:
        request = read_request(path)
    except SpoolFileError as err:
        try:  # the file name is the request id: the client is waiting on it
            _write_error(spool, validate_request_id(path.stem), str(err))
        except ValueError:
            LOG.error("dropping corrupt request file with an unusable name: %s", err)
        path.unlink(missing_ok=True)
        return False
    if isinstance(request, ShutdownRequest):
        LOG.info("shutdown request %s received", request.request_id)
        path.unlink(missing_ok=True)
        return True
    _serve(engine, request, spool, heartbeat)
    path.unlink(missing_ok=True)
    return False


def serve_forever(
    engine, spool: SpoolPaths, heartbeat: Heartbeat, poll_interval_s: float, parent_pid: int
) -> int:
    """The request loop; returns the process exit code."""
    heartbeat.update("ready", engine.served_weights)
    LOG.info("ready: serving %s from %s", engine.served_weights, spool.root)
    while True:
        pending = spool.pending_requests()
        if not pending:
            if os.getppid() != parent_pid:  # reparented: the trainer died without closing us
                LOG.error("parent process %d is gone; exiting", parent_pid)
                return EXIT_ORPHANED
            time.sleep(poll_interval_s)
            continue
        if _handle(pending[0], engine, spool, heartbeat):
            return EXIT_SHUTDOWN


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m prmppo.rollout.worker", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--spool", required=True, help="spool directory shared with the trainer")
    parser.add_argument("--engine", required=True, choices=sorted(ENGINE_CLASSES))
    parser.add_argument("--base-model", required=True, help="local HF-layout model directory")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--engine-options", type=json.loads, default={},
                        help="JSON object of extra keyword arguments for the engine class")
    parser.add_argument("--heartbeat-interval", type=float, default=1.0, help="seconds")
    parser.add_argument("--poll-interval", type=float, default=0.02, help="seconds")
    args = parser.parse_args(argv)
    if args.heartbeat_interval <= 0 or args.poll_interval <= 0:
        parser.error("--heartbeat-interval and --poll-interval must be > 0 seconds")
    if not isinstance(args.engine_options, dict):
        parser.error(f"--engine-options must be a JSON object, got {args.engine_options!r}")
    return args


def standby_main(engine: str, model_type: str = "") -> int:
    """`--standby ENGINE [MODEL_TYPE]` (`rollout/standby.py`): import the engine's module and, given a
    transformers `model_type`, that architecture's modeling module (which transformers would import
    lazily inside `from_pretrained`); then read one JSON line from stdin, {"argv": the worker's
    arguments, "log": its log file}, point stdout and stderr at that log and run as `main(argv)`. A
    closed stdin (the trainer took no worker) exits 0. A failed import is left for `main` to meet
    again and report through the heartbeat."""
    modules = [ENGINE_CLASSES[engine].split(":")[0]] if engine in ENGINE_CLASSES else []
    if model_type.isidentifier():
        modules.append(f"transformers.models.{model_type}.modeling_{model_type}")
    for module in modules:
        try:
            importlib.import_module(module)
        except Exception:  # noqa: BLE001 - main() builds the engine and reports why it cannot
            pass
    line = sys.stdin.readline()
    if not line.strip():
        return EXIT_SHUTDOWN
    order = json.loads(line)
    log = os.open(order["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    return main(order["argv"])


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--standby"] and len(argv) in (2, 3):
        return standby_main(*argv[1:])
    args = parse_args(argv)
    logging.basicConfig(
        stream=sys.stderr,
        level=logging.INFO,
        format=f"%(asctime)s %(levelname)s rollout-worker[{os.getpid()}] %(message)s",
    )
    parent_pid = os.getppid()
    spool = SpoolPaths(Path(args.spool))
    spool.make_dirs()
    heartbeat = Heartbeat(spool.heartbeat, args.heartbeat_interval)
    heartbeat.start()
    LOG.info("starting engine %r on %s (%s) from %s with options %s", args.engine, args.device, args.dtype,
             args.base_model, args.engine_options)
    try:
        engine = build_engine(args.engine, args.base_model, args.device, args.dtype, args.engine_options)
    except Exception as err:  # noqa: BLE001 - logged with the traceback, the cause goes to the client
        LOG.error("engine %r could not be built:\n%s", args.engine, traceback.format_exc())
        heartbeat.update("failed", None, error=startup_cause(args.engine, err))
        heartbeat.stop()
        return EXIT_ENGINE_FAILED
    try:
        return serve_forever(engine, spool, heartbeat, args.poll_interval, parent_pid)
    finally:
        heartbeat.stop()


if __name__ == "__main__":
    sys.exit(main())
