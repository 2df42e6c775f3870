"""Rollout: the engine worker process and the file-spool protocol the trainer drives it with.

`RolloutClient` (trainer side) starts `python -m prmppo.rollout.worker`, sends
`RolloutRequest`s and receives `RolloutResult`s through a spool directory (see `protocol`).
`HFEngine` (in `hf_engine`, imported lazily because it needs torch/transformers) is the
built-in engine the worker runs.
"""

from prmppo.rollout.client import RolloutClient
from prmppo.rollout.protocol import (
    ErrorResult,
    RolloutRequest,
    RolloutResult,
    RolloutWorkerError,
    ShutdownRequest,
    SpoolFileError,
    SpoolPaths,
    WeightsSpec,
    read_json,
    read_request,
    read_result,
    write_json_atomic,
)

__all__ = [
    "ErrorResult",
    "RolloutClient",
    "RolloutRequest",
    "RolloutResult",
    "RolloutWorkerError",
    "ShutdownRequest",
    "SpoolFileError",
    "SpoolPaths",
    "WeightsSpec",
    "read_json",
    "read_request",
    "read_result",
    "write_json_atomic",
]
