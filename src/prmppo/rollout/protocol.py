"""The file-spool protocol between the trainer and the rollout worker process.

The trainer (`RolloutClient`) and the worker (`python -m prmppo.rollout.worker`) share nothing
but a spool directory:

    <spool>/requests/<request_id>.json   written by the client, deleted by the worker when done
    <spool>/results/<request_id>.json    written by the worker, deleted by the client once read
    <spool>/heartbeat.json               rewritten by the worker every heartbeat interval:
                                         {pid, time, status, weights} (+ error when status is "failed")

Every file is a JSON object carrying `schema_version` (== SCHEMA_VERSION) and is written
atomically (temp file in the same directory, flush + fsync, `os.replace`), so a reader sees
either the whole previous file or the whole new one. Temp files start with "." and end with
".tmp"; readers skip them.

A request is a `RolloutRequest` ("type": "generate") or a `ShutdownRequest` ("type":
"shutdown"). A result is a `RolloutResult` or an `ErrorResult` (`{"request_id", "error"}`).
Both sides validate what they read; a file that is missing, truncated, not JSON, of another
schema version or lacking a field raises `SpoolFileError` naming the file.

Run the tests: `PYTHONPATH=src pytest tests/rollout/test_protocol.py -q`.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from prmppo.errors import PrmppoError
from prmppo.logger.metrics import write_json_atomic as write_json

SCHEMA_VERSION = 1
WEIGHT_KINDS = ("base", "checkpoint", "adapter", "shared", "live")
PATHLESS_KINDS = ("base", "live")  # weights the engine holds already: no path to load from
FINISH_REASONS = ("stop", "length")
HEARTBEAT_STATUSES = ("starting", "ready", "busy", "failed")  # "failed": the engine could not start
# A request id becomes a file name: keep it to a portable, non-hidden set of characters.
_REQUEST_ID_PATTERN = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}$")


class SpoolFileError(PrmppoError, RuntimeError):
    """A spool file is missing, truncated, not valid JSON, of another schema or lacks fields."""


class RolloutWorkerError(RuntimeError):
    """The rollout worker died, hung, timed out, or reported an error for a request."""


class EngineStartError(PrmppoError, RolloutWorkerError):
    """The worker's engine could not start (its package missing, out of memory, a model it cannot
    serve): a setup problem, reported in one line with the cause and the worker log path."""


# --------------------------------------------------------------------------- file I/O


def write_json_atomic(path: str | os.PathLike, obj: dict[str, Any]) -> None:
    """Write `obj` as JSON to `path` atomically; adds `schema_version` when absent.

    The temp file lives in the same directory so that `os.replace` is a rename on one
    filesystem (atomic on POSIX); fsync makes the content durable before the name appears.
    """
    # compact: rollout results carry every token id and logprob of an iteration
    write_json(path, {"schema_version": SCHEMA_VERSION, **obj}, indent=None)


def read_json(path: str | os.PathLike, what: str, required: tuple[str, ...] = ()) -> dict:
    """Read a spool JSON object, checking `schema_version` and the `required` keys.

    `what` names the file's role ("rollout result", "heartbeat", ...) for the error message.
    Raises SpoolFileError naming the file for every way the file can be unusable.
    """
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise SpoolFileError(f"{what} file {path} does not exist") from None
    except OSError as err:
        raise SpoolFileError(f"{what} file {path} cannot be read: {err}") from err
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as err:
        raise SpoolFileError(
            f"{what} file {path} is not valid JSON (truncated or corrupt, {len(text)} chars): {err}"
        ) from err
    if not isinstance(obj, dict):
        raise SpoolFileError(f"{what} file {path} holds a {type(obj).__name__}, expected an object")
    version = obj.get("schema_version")
    if version != SCHEMA_VERSION:
        raise SpoolFileError(
            f"{what} file {path} has schema_version={version!r}; this prmppo reads {SCHEMA_VERSION}"
        )
    missing = [key for key in required if key not in obj]
    if missing:
        raise SpoolFileError(f"{what} file {path} lacks field(s) {missing}")
    return obj


# --------------------------------------------------------------------------- messages


def validate_request_id(request_id: object) -> str:
    """Return `request_id` if it can be a spool file name, else raise ValueError."""
    if not isinstance(request_id, str) or not _REQUEST_ID_PATTERN.match(request_id):
        raise ValueError(
            f"request_id={request_id!r} is not a valid spool name: use 1-128 characters of "
            "letters, digits, '_', '.', '-', not starting with '.' or '-'"
        )
    return request_id


@dataclass(frozen=True)
class WeightsSpec:
    """Which weights the engine serves. `version` is the trainer's sync counter.

    kind "base": the worker's base model (path None); "checkpoint": a merged HF-layout dir
    (config.json + safetensors) at `path`; "adapter": a peft LoRA adapter dir at `path`,
    applied on the resident base; "shared": merged weights in a buffer shared with the trainer,
    described by the manifest in `path` (`rollout/shared_weights.py`; the built-in engine only);
    "live": the trainer's own weights as they are now (path None; the in-process engine only,
    `rollout/inprocess.py`).
    """

    kind: str
    path: str | None
    version: int

    def __post_init__(self) -> None:
        if self.kind not in WEIGHT_KINDS:
            raise ValueError(f"weights.kind={self.kind!r} is invalid; valid: {WEIGHT_KINDS}")
        if self.kind in PATHLESS_KINDS and self.path is not None:
            raise ValueError(f"weights.path must be null for kind={self.kind!r}, got {self.path!r}")
        if self.kind not in PATHLESS_KINDS and (not isinstance(self.path, str) or not self.path):
            raise ValueError(
                f"weights.path must be a directory for kind={self.kind!r}, got {self.path!r}"
            )
        if not isinstance(self.version, int) or isinstance(self.version, bool) or self.version < 0:
            raise ValueError(f"weights.version={self.version!r} must be an int >= 0")

    @classmethod
    def from_dict(cls, obj: object) -> "WeightsSpec":
        if not isinstance(obj, dict) or not {"kind", "path", "version"} <= obj.keys():
            raise ValueError(f"weights={obj!r} must be an object with kind, path, version")
        return cls(kind=obj["kind"], path=obj["path"], version=obj["version"])


def _check_int(name: str, value: object, minimum: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{name}={value!r} must be an int >= {minimum}")


def validate_sampling_args(
    prompt_token_ids: object,
    n_samples_per_prompt: object,
    max_new_tokens: object,
    temperature: object,
    top_p: object,
    seed: object,
    eos_token_id: object,
    pad_token_id: object,
) -> None:
    """Check the sampling arguments shared by requests and engines; errors name the field."""
    if not isinstance(prompt_token_ids, list) or not prompt_token_ids:
        raise ValueError(
            "prompt_token_ids must be a non-empty list of token-id lists, "
            f"got {prompt_token_ids!r:.80}"
        )
    for index, prompt in enumerate(prompt_token_ids):
        if not isinstance(prompt, list) or not prompt:
            raise ValueError(f"prompt_token_ids[{index}] must be a non-empty list of ints")
        if not all(isinstance(tok, int) and not isinstance(tok, bool) and tok >= 0 for tok in prompt):
            raise ValueError(f"prompt_token_ids[{index}] must hold ints >= 0, got {prompt[:8]}...")
    _check_int("n_samples_per_prompt", n_samples_per_prompt, 1)
    _check_int("max_new_tokens", max_new_tokens, 1)
    _check_int("seed", seed, 0)
    _check_int("eos_token_id", eos_token_id, 0)
    _check_int("pad_token_id", pad_token_id, 0)
    if not isinstance(temperature, (int, float)) or not math.isfinite(temperature) or temperature <= 0:
        raise ValueError(
            f"temperature={temperature!r} must be a finite number > 0 (greedy: use a small top_p)"
        )
    if not isinstance(top_p, (int, float)) or not 0 < top_p <= 1:
        raise ValueError(f"top_p={top_p!r} must be in (0, 1]")


@dataclass(frozen=True)
class RolloutRequest:
    """Sample `n_samples_per_prompt` responses for each prompt with the given weights."""

    request_id: str
    weights: WeightsSpec
    prompt_token_ids: list[list[int]]
    n_samples_per_prompt: int
    max_new_tokens: int
    temperature: float
    top_p: float
    seed: int
    eos_token_id: int
    pad_token_id: int

    def __post_init__(self) -> None:
        validate_request_id(self.request_id)
        if not isinstance(self.weights, WeightsSpec):
            raise ValueError(f"weights must be a WeightsSpec, got {type(self.weights).__name__}")
        validate_sampling_args(
            self.prompt_token_ids, self.n_samples_per_prompt, self.max_new_tokens, self.temperature,
            self.top_p, self.seed, self.eos_token_id, self.pad_token_id,
        )

    @property
    def n_rows(self) -> int:
        """Number of responses the result must hold: n_prompts * n_samples_per_prompt."""
        return len(self.prompt_token_ids) * self.n_samples_per_prompt

    def to_dict(self) -> dict[str, Any]:
        return {"schema_version": SCHEMA_VERSION, "type": "generate", **asdict(self)}

    @classmethod
    def from_dict(cls, obj: dict) -> "RolloutRequest":
        return _with_weights(cls, obj)


def _with_weights(cls, obj: dict):
    """Build dataclass `cls` from a spool dict whose `weights` field is a WeightsSpec dict."""
    fields = {name: obj[name] for name in cls.__dataclass_fields__}
    fields["weights"] = WeightsSpec.from_dict(obj["weights"])
    return cls(**fields)


@dataclass(frozen=True)
class ShutdownRequest:
    """Ask the worker to exit 0 once the requests before it are done."""

    request_id: str = "shutdown"

    def to_dict(self) -> dict[str, Any]:
        return {"schema_version": SCHEMA_VERSION, "type": "shutdown", "request_id": self.request_id}


@dataclass(frozen=True)
class RolloutResult:
    """What the engine sampled. Rows are prompt-major: prompt i's samples at i*n .. i*n+n-1.

    `token_ids[r]` are response tokens only (EOS included when the row stopped on it);
    `logprobs[r][t]` is log_softmax(logits / temperature) at that token, before top-p
    truncation, so it equals what a full forward pass at the same temperature gives.
    `weights` is what the engine actually served; `load_seconds` the time it took to load them for
    this request (0 when they were already served), `generate_seconds` the time sampling took.
    """

    request_id: str
    weights: WeightsSpec
    token_ids: list[list[int]]
    logprobs: list[list[float]]
    finish_reasons: list[str]
    generate_seconds: float
    load_seconds: float

    def __post_init__(self) -> None:
        rows = len(self.token_ids)
        if len(self.logprobs) != rows or len(self.finish_reasons) != rows:
            raise ValueError(
                f"result {self.request_id}: {rows} token rows, {len(self.logprobs)} logprob rows, "
                f"{len(self.finish_reasons)} finish reasons; all must be equal"
            )
        for row, (tokens, logprobs) in enumerate(zip(self.token_ids, self.logprobs)):
            if len(tokens) != len(logprobs):
                raise ValueError(
                    f"result {self.request_id}: row {row} has {len(tokens)} tokens "
                    f"but {len(logprobs)} logprobs"
                )
        bad = [reason for reason in self.finish_reasons if reason not in FINISH_REASONS]
        if bad:
            raise ValueError(
                f"result {self.request_id}: finish reasons {bad[:3]} not in {FINISH_REASONS}"
            )

    def to_dict(self) -> dict[str, Any]:
        return {"schema_version": SCHEMA_VERSION, "type": "result", **asdict(self)}

    @classmethod
    def from_dict(cls, obj: dict) -> "RolloutResult":
        return _with_weights(cls, obj)


@dataclass(frozen=True)
class ErrorResult:
    """The worker could not serve `request_id`; `error` is its message (with traceback)."""

    request_id: str
    error: str

    def to_dict(self) -> dict[str, Any]:
        return {"schema_version": SCHEMA_VERSION, "type": "error", **asdict(self)}


def read_request(path: str | os.PathLike) -> RolloutRequest | ShutdownRequest:
    """Parse a request file; SpoolFileError (naming the file) when it is unusable."""
    obj = read_json(path, "rollout request", required=("type", "request_id"))
    try:
        if obj["type"] == "shutdown":
            return ShutdownRequest(request_id=validate_request_id(obj["request_id"]))
        if obj["type"] != "generate":
            raise ValueError(f"type={obj['type']!r} is invalid; valid: 'generate', 'shutdown'")
        missing = [name for name in RolloutRequest.__dataclass_fields__ if name not in obj]
        if missing:
            raise ValueError(f"lacks field(s) {missing}")
        return RolloutRequest.from_dict(obj)
    except (ValueError, TypeError) as err:
        raise SpoolFileError(f"rollout request file {path} is invalid: {err}") from err


def read_result(path: str | os.PathLike) -> RolloutResult | ErrorResult:
    """Parse a result file; SpoolFileError (naming the file) when it is unusable."""
    obj = read_json(path, "rollout result", required=("request_id",))
    try:
        if "error" in obj:
            return ErrorResult(request_id=str(obj["request_id"]), error=str(obj["error"]))
        missing = [name for name in RolloutResult.__dataclass_fields__ if name not in obj]
        if missing:
            raise ValueError(f"lacks field(s) {missing}")
        return RolloutResult.from_dict(obj)
    except (ValueError, TypeError) as err:
        raise SpoolFileError(f"rollout result file {path} is invalid: {err}") from err


# --------------------------------------------------------------------------- layout


@dataclass(frozen=True)
class SpoolPaths:
    """The spool directory layout, in one place for client and worker."""

    root: Path

    @property
    def requests_dir(self) -> Path:
        return self.root / "requests"

    @property
    def results_dir(self) -> Path:
        return self.root / "results"

    @property
    def heartbeat(self) -> Path:
        return self.root / "heartbeat.json"

    def request(self, request_id: str) -> Path:
        return self.requests_dir / f"{validate_request_id(request_id)}.json"

    def result(self, request_id: str) -> Path:
        return self.results_dir / f"{validate_request_id(request_id)}.json"

    def make_dirs(self) -> None:
        self.requests_dir.mkdir(parents=True, exist_ok=True)
        self.results_dir.mkdir(parents=True, exist_ok=True)

    def pending_requests(self) -> list[Path]:
        """Request files, oldest first (mtime, then name); temp files are skipped."""
        paths = []
        for path in self.requests_dir.glob("*.json"):
            try:
                paths.append((path.stat().st_mtime_ns, path.name, path))
            except FileNotFoundError:  # removed between glob and stat
                continue
        return [path for _, _, path in sorted(paths)]
