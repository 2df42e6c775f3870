"""The trainer's side of the rollout protocol: start, feed, watch and stop the worker process.

    with RolloutClient(spool_dir, "hf", base_model_dir, log_path, startup_timeout_s=300,
                       request_timeout_s=1800, heartbeat_timeout_s=60) as client:
        result = client.generate(RolloutRequest(...))

A run builds it from its `rollout` config node (`rollout_client`, that node's `_target_`), whose
schema (`config/schema.py RolloutConfig`) holds the timeouts' defaults; the class has none.

`start()` clears stale spool files, launches `python -m prmppo.rollout.worker` (output appended
to `log_path`) with `python` (the trainer's interpreter, or an engine's own environment: the
worker's PYTHONPATH gets a directory holding only a link to this prmppo package, see
`worker_import_dir`) and waits for the heartbeat to say "ready" (`launch()` and `wait_ready()` are
its two halves, so the worker's start can overlap the trainer's own set-up); an engine that cannot start
raises `EngineStartError` with the worker's one-line cause and the log path
(`probe_engine_python` checks beforehand, in seconds, that an interpreter can run an engine).
`generate()` writes the request and polls for its result while watching three ways the worker
can fail: the process exited (error with the exit code, the log's last lines and the log path),
the heartbeat went stale (a hung worker), or the request timed out. Nothing here waits forever; after a dead, hung or timed-out
worker the client kills it and must be `start()`ed again.

Run the tests: `PYTHONPATH=src pytest tests/rollout/test_worker.py -q`.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from prmppo.rollout import standby
from prmppo.rollout.process import resolve_python, worker_env, worker_import_dir
from prmppo.rollout.protocol import (
    EngineStartError,
    ErrorResult,
    RolloutRequest,
    RolloutResult,
    RolloutWorkerError,
    ShutdownRequest,
    SpoolFileError,
    SpoolPaths,
    WeightsSpec,
    read_json,
    read_result,
    write_json_atomic,
)

LOG_TAIL_LINES = 30
LOG = logging.getLogger("prmppo.rollout.client")
POLL_INTERVAL_S = 0.02
SHUTDOWN_GRACE_S = 5.0
PROBE_TIMEOUT_S = 180.0
WORKER_IMPORT_DIR = "worker_pythonpath"  # in the spool: the worker's view of prmppo


def probe_engine_python(python: str, packages: tuple[str, ...], timeout_s: float = PROBE_TIMEOUT_S) -> dict:
    """Run `python` once to import `packages` and the worker module as the worker would; returns
    {"python", "versions": {package: version}, "platform": vLLM's device type or None,
    "attention_head_sizes": what vLLM's CPU attention supports, or None}. Raises ValueError with a
    one-line reason when the interpreter is missing, fails to import, or does not answer in time."""
    if not os.path.isfile(python) or not os.access(python, os.X_OK):
        raise ValueError(f"{python} does not exist or is not an executable file")
    script = (
        "import importlib, json\n"
        "import prmppo.rollout.worker\n"
        f"packages = {list(packages)!r}\n"
        "versions = {p: getattr(importlib.import_module(p), '__version__', '?') for p in packages}\n"
        "platform = sizes = None\n"
        "if 'vllm' in packages:\n"
        "    from vllm.platforms import current_platform\n"
        "    platform = current_platform.device_type\n"
        "    if platform == 'cpu':\n"
        "        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend\n"
        "        sizes = CPUAttentionBackend.get_supported_head_sizes()\n"
        "print('PRMPPO_PROBE ' + json.dumps({'versions': versions, 'platform': platform, "
        "'attention_head_sizes': sizes}))\n"
    )
    try:
        with tempfile.TemporaryDirectory(prefix="prmppo-probe-") as scratch:
            env = worker_env(worker_import_dir(Path(scratch)))
            done = subprocess.run([python, "-c", script], capture_output=True, text=True, timeout=timeout_s,
                                  env=env, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        raise ValueError(f"{python} did not import {list(packages)} within {timeout_s:.0f} s") from None
    except OSError as err:
        raise ValueError(f"{python} cannot be run: {err}") from err
    answer = [line for line in done.stdout.splitlines() if line.startswith("PRMPPO_PROBE ")]
    if done.returncode != 0 or not answer:
        errors = [line for line in done.stderr.strip().splitlines() if line.strip()]
        raise ValueError(f"{python} cannot import {list(packages)}: {errors[-1] if errors else 'no output'}")
    return {"python": python, **json.loads(answer[-1].removeprefix("PRMPPO_PROBE "))}


def log_tail(log_path: Path, lines: int = LOG_TAIL_LINES) -> str:
    """The last `lines` lines of the worker log, or a note saying why there are none."""
    try:
        with open(log_path, "rb") as handle:
            handle.seek(0, os.SEEK_END)
            handle.seek(max(0, handle.tell() - 64 * 1024))  # the tail is in the last 64 KiB
            text = handle.read().decode("utf-8", errors="replace")
    except OSError as err:
        return f"(worker log {log_path} unreadable: {err})"
    return "\n".join(text.splitlines()[-lines:])


class RolloutClient:
    """Runs one rollout worker process and exchanges requests and results with it."""

    def __init__(
        self,
        spool_dir: str | os.PathLike,
        engine: str,
        base_model_dir: str | os.PathLike,
        log_path: str | os.PathLike,
        *,
        startup_timeout_s: float,
        request_timeout_s: float,
        heartbeat_timeout_s: float,
        device: str = "cpu",
        dtype: str = "float32",
        python: str = sys.executable,
        env: dict[str, str] | None = None,
        engine_options: dict | None = None,
    ) -> None:
        timeouts = {"startup_timeout_s": startup_timeout_s, "request_timeout_s": request_timeout_s,
                    "heartbeat_timeout_s": heartbeat_timeout_s}
        for name, value in timeouts.items():
            if not value > 0:
                raise ValueError(f"{name}={value!r} must be > 0 seconds")
        self.spool = SpoolPaths(Path(spool_dir))
        self.engine = engine
        self.base_model_dir = str(base_model_dir)
        self.log_path = Path(log_path)
        self.device, self.dtype, self.python = device, dtype, python
        self.startup_timeout_s = startup_timeout_s
        self.request_timeout_s = request_timeout_s
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.env = env
        self.engine_options = dict(engine_options or {})
        self._proc: subprocess.Popen | None = None
        self._launched_at = 0.0
        self._served: WeightsSpec | None = None

    # ------------------------------------------------------------------ lifecycle

    @property
    def served_weights(self) -> WeightsSpec | None:
        """The weights the engine served for the last result (None before the first)."""
        return self._served

    @property
    def pid(self) -> int | None:
        """The worker's process id (also after it died), None before start / after close."""
        return None if self._proc is None else self._proc.pid

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def __enter__(self) -> "RolloutClient":
        """Start the worker, or wait for the one `launch` started, until its heartbeat says "ready"."""
        if self._proc is None:
            self.launch()
        self.wait_ready()
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def _clear_spool(self) -> None:
        self.spool.make_dirs()
        self._refuse_if_live_worker()
        for directory in (self.spool.requests_dir, self.spool.results_dir):
            for stale in directory.glob("*.json"):
                stale.unlink(missing_ok=True)
        for directory in (self.spool.root, self.spool.requests_dir, self.spool.results_dir):
            for stale in directory.glob(".*.tmp"):  # left by a writer killed mid-write
                stale.unlink(missing_ok=True)
        self.spool.heartbeat.unlink(missing_ok=True)

    def _refuse_if_live_worker(self) -> None:
        """Two workers on one spool would steal each other's requests."""
        try:
            beat = read_json(self.spool.heartbeat, "heartbeat", required=("pid", "time"))
            os.kill(int(beat["pid"]), 0)
        except (SpoolFileError, ProcessLookupError, PermissionError, ValueError, TypeError):
            return
        if time.time() - float(beat["time"]) < self.heartbeat_timeout_s:
            raise RolloutWorkerError(
                f"spool {self.spool.root} is in use by a live worker (pid {beat['pid']}, fresh heartbeat); "
                "close it or use another spool_dir"
            )

    def start(self) -> None:
        """Launch the worker and wait until its heartbeat says "ready"."""
        self.launch()
        self.wait_ready()

    def launch(self) -> None:
        """Start the worker process and return at once: its imports and engine load overlap with
        whatever the caller does next; `wait_ready` (or entering the client) waits for it."""
        if self._proc is not None and self._proc.poll() is None:
            raise RolloutWorkerError(f"worker pid {self._proc.pid} is already running; close() it first")
        self._clear_spool()
        command = [
            self.python, "-m", "prmppo.rollout.worker", "--spool", str(self.spool.root),
            "--engine", self.engine, "--base-model", self.base_model_dir,
            "--device", self.device, "--dtype", self.dtype, "--engine-options", json.dumps(self.engine_options),
        ]
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        waiting = standby.take(self.python, self.engine) if self.env is None else None
        if waiting is not None and standby.activate(waiting, command[3:], self.log_path):
            self._proc = waiting  # it runs `main(command[3:])` with its output in the log
            LOG.info("rollout worker: the standby started with the run (pid %d), its imports done or under way",
                     waiting.pid)
        else:
            with open(self.log_path, "ab") as log_file:  # the child keeps its own copy of the fd
                # its own session: a SIGTERM to the trainer's process group (torchrun or SLURM stopping the job)
                # must not kill the engine mid-request before the coordinated stop; the trainer closes it, and
                # it exits by itself when the trainer dies (the parent check in the worker's loop)
                self._proc = subprocess.Popen(
                    command, stdin=subprocess.DEVNULL, stdout=log_file, stderr=subprocess.STDOUT,
                    env=worker_env(worker_import_dir(self.spool.root / WORKER_IMPORT_DIR), self.env),
                    start_new_session=True,
                )
        self._served = None
        self._launched_at = time.monotonic()

    def wait_ready(self) -> None:
        """Wait until the launched worker's heartbeat says "ready" (within `startup_timeout_s` of the launch)."""
        if self._proc is None:
            raise RolloutWorkerError("rollout worker is not running: call launch() or start() first")
        deadline = self._launched_at + self.startup_timeout_s
        while time.monotonic() < deadline:
            beat = self._read_heartbeat()
            if beat is not None and beat["status"] == "failed" or self._proc.poll() is not None:
                self._raise_start_failure()
            if beat is not None and beat["status"] == "ready":
                return
            time.sleep(POLL_INTERVAL_S)
        self._kill()
        raise RolloutWorkerError(
            f"rollout worker not ready after startup_timeout_s={self.startup_timeout_s}; killed it. "
            f"Worker log {self.log_path}, last lines:\n{log_tail(self.log_path)}"
        )

    def _raise_start_failure(self) -> None:
        """The engine did not come up: EngineStartError when the worker said why, else the exit code."""
        try:
            self._proc.wait(timeout=SHUTDOWN_GRACE_S)
        except subprocess.TimeoutExpired:
            self._kill()
        beat = self._read_heartbeat()
        if beat is not None and beat["status"] == "failed":
            raise EngineStartError(f"rollout engine {self.engine!r} could not start: {beat.get('error')} "
                                   f"(worker log {self.log_path})")
        hint = " (signal 9: killed, e.g. by the kernel's out-of-memory killer)" if self._proc.returncode == -9 else ""
        self._raise_if_dead(f"while starting{hint}")

    def close(self) -> None:
        """Ask the worker to exit, then terminate / kill it if it does not. Idempotent."""
        proc, self._proc = self._proc, None
        if proc is None or proc.poll() is not None:
            return
        try:
            shutdown = ShutdownRequest(f"shutdown-{time.time_ns()}")
            write_json_atomic(self.spool.request(shutdown.request_id), shutdown.to_dict())
            proc.wait(timeout=SHUTDOWN_GRACE_S)
            return
        except (OSError, subprocess.TimeoutExpired):
            pass
        proc.terminate()
        try:
            proc.wait(timeout=SHUTDOWN_GRACE_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=SHUTDOWN_GRACE_S)

    def _kill(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait(timeout=SHUTDOWN_GRACE_S)

    # ------------------------------------------------------------------ health

    def _raise_if_dead(self, doing: str) -> None:
        if self._proc is None:
            raise RolloutWorkerError("rollout worker is not running: call start() first")
        code = self._proc.poll()
        if code is not None:
            raise RolloutWorkerError(
                f"rollout worker pid {self._proc.pid} exited with code {code} {doing}. "
                f"Worker log {self.log_path}, last lines:\n{log_tail(self.log_path)}"
            )

    def _read_heartbeat(self) -> dict | None:
        """The worker's heartbeat, or None while it has not written one yet."""
        if not self.spool.heartbeat.exists():
            return None
        return read_json(self.spool.heartbeat, "heartbeat", required=("pid", "time", "status", "weights"))

    def _raise_if_hung(self, request_id: str) -> None:
        beat = self._read_heartbeat()
        age_s = time.time() - float(beat["time"]) if beat is not None else float("inf")
        if age_s > self.heartbeat_timeout_s:
            self._kill()
            raise RolloutWorkerError(
                f"rollout worker hung: heartbeat {self.spool.heartbeat} is {age_s:.1f}s old "
                f"(heartbeat_timeout_s={self.heartbeat_timeout_s}) while waiting for request {request_id}; "
                f"killed it. Worker log {self.log_path}, last lines:\n{log_tail(self.log_path)}"
            )

    # ------------------------------------------------------------------ requests

    def generate(self, request: RolloutRequest) -> RolloutResult:
        """Send `request` and wait for its result; raises RolloutWorkerError / SpoolFileError."""
        if not isinstance(request, RolloutRequest):
            raise TypeError(f"generate() takes a RolloutRequest, got {type(request).__name__}")
        self._raise_if_dead("before the request was sent")
        result_path = self.spool.result(request.request_id)
        if result_path.exists() or self.spool.request(request.request_id).exists():
            raise RolloutWorkerError(
                f"request_id {request.request_id!r} is already in the spool; use a fresh id"
            )
        write_json_atomic(self.spool.request(request.request_id), request.to_dict())
        deadline = time.monotonic() + self.request_timeout_s
        while not result_path.exists():
            if self._proc.poll() is not None and not result_path.exists():
                self._raise_if_dead(f"while serving request {request.request_id}")
            self._raise_if_hung(request.request_id)
            if time.monotonic() > deadline:
                self._kill()
                raise RolloutWorkerError(
                    f"request {request.request_id} timed out after "
                    f"request_timeout_s={self.request_timeout_s}; killed the worker. "
                    f"Worker log {self.log_path}, last lines:\n{log_tail(self.log_path)}"
                )
            time.sleep(POLL_INTERVAL_S)
        result = read_result(result_path)
        result_path.unlink(missing_ok=True)
        return self._check_result(request, result, result_path)

    def _check_result(self, request: RolloutRequest, result, result_path: Path) -> RolloutResult:
        if result.request_id != request.request_id:
            raise SpoolFileError(
                f"result file {result_path} answers request {result.request_id!r}, "
                f"expected {request.request_id!r}"
            )
        if isinstance(result, ErrorResult):
            raise RolloutWorkerError(
                f"rollout worker failed request {request.request_id} (log {self.log_path}):\n{result.error}"
            )
        if len(result.token_ids) != request.n_rows:
            raise SpoolFileError(
                f"result file {result_path} has {len(result.token_ids)} rows, expected "
                f"{len(request.prompt_token_ids)} prompts x {request.n_samples_per_prompt} samples "
                f"= {request.n_rows}"
            )
        too_long = [row for row, tokens in enumerate(result.token_ids)
                    if len(tokens) > request.max_new_tokens]
        if too_long:
            raise SpoolFileError(
                f"result file {result_path} rows {too_long[:5]} exceed max_new_tokens={request.max_new_tokens}"
            )
        if result.weights != request.weights:  # the ratio tripwire would fire later, less clearly
            raise RolloutWorkerError(
                f"rollout worker served weights {result.weights} for request {request.request_id}, "
                f"which asked for {request.weights}"
            )
        self._served = result.weights
        return result


def rollout_client(engine: str, python: str, sync: str, sync_every_iterations: int, startup_timeout_s: float,
                   request_timeout_s: float, heartbeat_timeout_s: float, gpu_memory_utilization: float,
                   decode: str, compile_decode: bool, standby: bool, *,
                   spool_dir: str | os.PathLike, base_model_dir: str | os.PathLike, log_path: str | os.PathLike,
                   device: str, dtype: str, lora_rank: int, seed: int) -> RolloutClient:
    """The (not yet started) worker client a run's `rollout` config node describes: that node's `_target_`.

    The run passes what only it knows (spool, base checkpoint, log, engine device, dtype, the LoRA rank and
    the seed). vLLM gets its memory share, the seed, and the LoRA rank to reserve when adapters are synced
    (`sync=adapter`; 0 otherwise); the built-in engine gets its `decode` loop and `compile_decode` (vLLM
    reads neither). `sync_every_iterations` belongs to the weight sync (`ppo/sync.py WeightSync`).
    """
    del sync_every_iterations, standby  # the weight sync's, and the entry point's (rollout/standby.py)
    if engine == "vllm":
        options = {"gpu_memory_utilization": gpu_memory_utilization, "seed": seed,
                   "max_lora_rank": lora_rank if sync == "adapter" else 0}
    else:
        options = {"decode": decode, "compile_decode": compile_decode}
    return RolloutClient(spool_dir, engine, base_model_dir, log_path, startup_timeout_s=startup_timeout_s,
                         request_timeout_s=request_timeout_s, heartbeat_timeout_s=heartbeat_timeout_s,
                         device=device, dtype=dtype, python=resolve_python(python), engine_options=options)
