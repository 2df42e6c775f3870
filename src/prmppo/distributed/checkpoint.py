"""Checkpoints of N ranks: the trainable weights and the policy optimizer as a sharded
`torch.distributed.checkpoint` (DCP) save, the rest as the one-process checkpoint holds it.

    it<NNNNNN>/sharded/            DCP: every rank writes its shards of the trainable parameters
                                   (frozen base weights are not saved: they are the SFT checkpoint's)
                                   and of their AdamW state; `.metadata` is written last by rank 0
    it<NNNNNN>/value_head.safetensors, optim.pt (value optimizer, LR scheduler), rng.pt, reward.pt
    it<NNNNNN>/checkpoint.json     written last, by rank 0, with `world_size`

The directory is written as `it<NNNNNN>.partial` and renamed by rank 0 after every rank has
finished (a barrier), the one-process rule: a kill at any point leaves either the previous
complete checkpoint or a `.partial` that is never read. Resume needs the same world size: the
DCP shards would reshard, but the sampled rows split across ranks differently, so the run would
not continue the way the uninterrupted one would have (a different sum order is 1e-7, not 0, and
only the same world size is tested); a different world size is refused with that reason.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from prmppo.checkpoint_format import (VALUE_HEAD_FILE, CheckpointError, checkpoint_name, prune_checkpoints,
                                      read_meta, restore_run_state, save_value_head, write_marker)

OPTIONS = StateDictOptions(ignore_frozen_params=True)
# loading: the frozen weights are absent on purpose (checked below: nothing trainable may be missing)
LOAD_OPTIONS = StateDictOptions(ignore_frozen_params=True, strict=False)


def _sharded_state(policy, trainer) -> dict:
    if trainer.masters.pairs:
        raise CheckpointError("topology=fsdp keeps fp32 sharded weights (bf16 is the compute dtype only), so there "
                              "are no separate master weights to save; load the model in float32 (model.dtype)")
    model_state, optim_state = get_state_dict(policy.model, trainer.policy_optimizer, options=OPTIONS)
    return {"model": model_state, "optim": optim_state}


def _save_plain(tmp: Path, next_iteration: int, policy, trainer, world_size: int, extra: dict) -> None:
    """Rank 0: everything but the sharded weights, then the marker."""
    save_value_head(policy, tmp / VALUE_HEAD_FILE)
    torch.save({"value_optimizer": None if trainer.value_optimizer is None else trainer.value_optimizer.state_dict(),
                "scheduler": trainer.scheduler.state_dict()}, tmp / "optim.pt")
    torch.save({"cpu": torch.get_rng_state()}, tmp / "rng.pt")
    torch.save(trainer.reward.state_dict(), tmp / "reward.pt")
    write_marker(tmp, next_iteration, trainer, extra, world_size=world_size)


def save_sharded(checkpoints_dir: Path, next_iteration: int, policy, trainer, ranks, extra: dict) -> Path:
    """Every rank calls this; returns the complete checkpoint's directory."""
    final = Path(checkpoints_dir) / checkpoint_name(next_iteration)
    tmp = final.with_name(final.name + ".partial")
    if ranks.is_main:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    ranks.barrier()
    dcp.save(_sharded_state(policy, trainer), checkpoint_id=str(tmp / "sharded"))
    ranks.barrier()  # every rank's shards are on disk
    if ranks.is_main:
        _save_plain(tmp, next_iteration, policy, trainer, ranks.world_size, extra)
        shutil.rmtree(final, ignore_errors=True)  # a re-save of the same iteration after a resume
        tmp.rename(final)
    ranks.barrier()
    return final


def _check_fits(ckpt_dir: Path, meta: dict, trainer, world_size: int) -> None:
    if "world_size" not in meta:
        raise CheckpointError(f"{ckpt_dir} was written by a one-process run (topology=cpu or gpu); resume it with "
                              "that topology, or use a new run dir")
    if meta["world_size"] != world_size:
        raise CheckpointError(f"{ckpt_dir} was written by {meta['world_size']} ranks and this launch has {world_size}: "
                              "the rows of each minibatch would split across ranks differently from the run that "
                              f"wrote it; relaunch with topology.train_world_size={meta['world_size']} "
                              f"(torchrun --nproc_per_node={meta['world_size']})")
    if meta["planned_policy_steps"] != trainer.shape.policy_steps:
        raise CheckpointError(f"{ckpt_dir} was written by a run of {meta['planned_policy_steps']} planned policy "
                              f"optimizer steps; this config plans {trainer.shape.policy_steps}: resume with the same "
                              "ppo settings or use a new run dir")


def load_sharded(ckpt_dir: Path, policy, trainer, ranks) -> int:
    """Every rank calls this; restores weights, optimizers, scheduler, counters, RNG, reward; returns the
    next iteration."""
    ckpt_dir = Path(ckpt_dir)
    meta = read_meta(ckpt_dir)
    _check_fits(ckpt_dir, meta, trainer, ranks.world_size)
    state = _sharded_state(policy, trainer)
    dcp.load(state, checkpoint_id=str(ckpt_dir / "sharded"))
    result = set_state_dict(policy.model, trainer.policy_optimizer, model_state_dict=state["model"],
                            optim_state_dict=state["optim"], options=LOAD_OPTIONS)
    trainable = {name for name, p in policy.model.named_parameters() if p.requires_grad}
    missing = sorted(trainable & set(result.missing_keys))
    if missing or result.unexpected_keys:
        raise CheckpointError(f"{ckpt_dir}/sharded does not fit this policy: trainable weights missing {missing[:3]}, "
                              f"unexpected {list(result.unexpected_keys)[:3]}")
    if policy.value_head is not None:
        device = str(next(policy.value_head.parameters()).device)
        policy.value_head.load_state_dict(load_file(str(ckpt_dir / VALUE_HEAD_FILE), device=device))
    optim = torch.load(ckpt_dir / "optim.pt", weights_only=True, map_location="cpu")
    return restore_run_state(ckpt_dir, meta, trainer, optim)  # rng.pt here holds the CPU state only


class ShardedCheckpoints:
    """The checkpoint store of N ranks (every rank calls each method): sharded saves and loads, rank 0
    prunes and owns the run's files; the one-process store's counterpart (`ppo/checkpoint.py`), asked
    for through `TorchRanks.checkpoints`."""

    def __init__(self, ranks):
        self.ranks = ranks
        self.writes_run_files = ranks.is_main  # metrics.jsonl and canary.jsonl are rank 0's

    def save(self, checkpoints_dir: Path, next_iteration: int, policy, trainer, extra: dict) -> Path:
        return save_sharded(checkpoints_dir, next_iteration, policy, trainer, self.ranks, extra)

    def load(self, ckpt_dir: Path, policy, trainer) -> int:
        return load_sharded(ckpt_dir, policy, trainer, self.ranks)

    def prune(self, checkpoints_dir: Path, keep: int, pinned: tuple[Path, ...]) -> None:
        if self.ranks.is_main:
            prune_checkpoints(checkpoints_dir, keep, pinned)
        self.ranks.barrier()
