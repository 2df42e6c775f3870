"""Sharded checkpoints fit only the launch that wrote them: a one-process run does not read one, and a
different world size is refused with the reason (the resharded run would split its rows differently)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from prmppo.distributed.checkpoint import _check_fits
from prmppo.logger import write_json_atomic
from prmppo.ppo.checkpoint import FORMAT_VERSION, MARKER, CheckpointError, load_checkpoint

TRAINER = SimpleNamespace(shape=SimpleNamespace(policy_steps=8))


def _marker(tmp_path, **fields) -> dict:
    meta = {"format": FORMAT_VERSION, "next_iteration": 2, "planned_policy_steps": 8, "files": {}, **fields}
    write_json_atomic(tmp_path / MARKER, meta)
    return meta


def test_a_sharded_checkpoint_is_refused_by_a_one_process_run(tmp_path):
    _marker(tmp_path, world_size=2)
    with pytest.raises(CheckpointError, match=r"written by 2 ranks under topology=fsdp; resume it with that topology"):
        load_checkpoint(tmp_path, policy=None, trainer=TRAINER)


def test_a_different_world_size_is_refused_with_the_reason(tmp_path):
    meta = _marker(tmp_path, world_size=2)
    with pytest.raises(CheckpointError, match=r"written by 2 ranks and this launch has 4: the rows of each minibatch "
                                              r"would split across ranks differently.*torchrun --nproc_per_node=2"):
        _check_fits(tmp_path, meta, TRAINER, world_size=4)
    _check_fits(tmp_path, meta, TRAINER, world_size=2)  # the same world size fits


def test_a_one_process_checkpoint_is_refused_by_a_sharded_run(tmp_path):
    meta = _marker(tmp_path)
    with pytest.raises(CheckpointError, match=r"written by a one-process run"):
        _check_fits(tmp_path, meta, TRAINER, world_size=2)
