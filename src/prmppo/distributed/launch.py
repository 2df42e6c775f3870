"""Launch gates and the process group for `topology=fsdp`.

    torchrun --nproc_per_node=N -m prmppo stage=ppo topology=fsdp topology.train_world_size=N \
        hydra.run.dir=runs/<name> ...

(stages sft, prm, ppo and pipeline; `config/validate.py` refuses the others under topology=fsdp).

Every rank composes the same config. The run directory must be given (`hydra.run.dir`): Hydra's
default is a timestamp, which differs between processes started a second apart, so each rank
would write into a directory of its own. `python -m prmppo` refuses a multi-rank launch without
it, and `init_ranks` checks that every rank got the same `run_dir` before any work (a
programmatic `run(cfg)` is held to the same rule).

Process group: gloo when `topology.train_device=cpu` (CI), NCCL on CUDA with one rank per GPU
(`cuda:LOCAL_RANK`). Rank 0 alone writes the run's files (metrics.jsonl, banner.json,
stage_result.json, W&B, checkpoints' plain files); every rank logs to `<run_dir>/rank<N>.log`.
A rank that dies ends the job: torchrun stops the others and exits non-zero; a rank that hangs
in a collective is ended by the process group's timeout (`COLLECTIVE_TIMEOUT`).
"""

from __future__ import annotations

import logging
import os
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from prmppo.distributed.ranks import OneProcess, TorchRanks
from prmppo.errors import PrmppoError

log = logging.getLogger("prmppo")

# how long a rank waits in a collective for the others (a dead or hung peer ends the job after this)
COLLECTIVE_TIMEOUT = timedelta(minutes=10)
TORCHRUN_KEYS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


class LaunchError(PrmppoError):
    """A launch that does not match its topology (torchrun missing, world size, run directory)."""


def torchrun_command(world_size: int) -> str:
    return (f"torchrun --nproc_per_node={world_size} -m prmppo stage=ppo topology=fsdp "
            f"topology.train_world_size={world_size} hydra.run.dir=runs/<name> ...")


def torchrun_world_size(environ=os.environ) -> int | None:
    """WORLD_SIZE when this process was started by torchrun (all of its variables set), else None."""
    if not all(key in environ for key in TORCHRUN_KEYS):
        return None
    return int(environ["WORLD_SIZE"])


def ranks_on_this_node(train_world_size: int, environ=os.environ) -> int:
    """The training ranks (one GPU each) on this machine: torchrun's LOCAL_WORLD_SIZE (several nodes share
    `topology.train_world_size`), or all of them outside torchrun."""
    return int(environ.get("LOCAL_WORLD_SIZE", train_world_size)) if torchrun_world_size(environ) else train_world_size


def check_launch(topology_name: str, train_world_size: int, environ=os.environ) -> None:
    """`topology=fsdp` runs under torchrun with WORLD_SIZE == topology.train_world_size; any other
    topology on one process (N copies of a one-process job would each run the whole job)."""
    world = torchrun_world_size(environ)
    if topology_name == "fsdp":
        if world is None:
            raise LaunchError(f"topology=fsdp needs torchrun (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT "
                              f"are not all set); launch it as: {torchrun_command(train_world_size)}")
        if world != train_world_size:
            raise LaunchError(f"topology.train_world_size={train_world_size} but torchrun started WORLD_SIZE={world} "
                              f"processes; make them equal (e.g. {torchrun_command(world)})")
    elif world is not None and world > 1:
        raise LaunchError(f"topology={topology_name} under torchrun with WORLD_SIZE={world}: every process would run "
                          f"the whole job; use topology=fsdp topology.train_world_size={world}")


def _device(train_device: str, local_rank: int) -> torch.device:
    if torch.device(train_device).type == "cuda":
        if not torch.cuda.is_available():
            raise LaunchError(f"topology.train_device={train_device!r} but no CUDA device is visible; use "
                              "topology.train_device=cpu (gloo) for CPU ranks")
        torch.cuda.set_device(local_rank)  # one rank per GPU: NCCL and every .cuda() use this one
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def init_ranks(topology_name: str, train_device: str, run_dir: Path, environ=os.environ):
    """`OneProcess` for a one-process topology; for `fsdp`, join the process group (gloo on CPU, NCCL on
    CUDA), check that every rank has the same run dir, and log this rank to `<run_dir>/rank<N>.log`."""
    if topology_name != "fsdp":
        return OneProcess(torch.device(train_device))
    rank, local_rank = int(environ["RANK"]), int(environ["LOCAL_RANK"])
    device = _device(train_device, local_rank)
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", timeout=COLLECTIVE_TIMEOUT,
                                device_id=device if device.type == "cuda" else None)
    ranks = TorchRanks(device=device, rank=rank, world_size=dist.get_world_size(), is_main=rank == 0)
    dirs = [None] * ranks.world_size
    dist.all_gather_object(dirs, str(Path(run_dir).resolve()))
    if len(set(dirs)) > 1:
        dist.barrier()  # every rank has its answer before the group goes; a group left to exit time aborts gloo
        dist.destroy_process_group()
        raise LaunchError(f"the ranks were given different run dirs ({', '.join(sorted(set(dirs)))}): give one "
                          "with hydra.run.dir=<dir> (Hydra's default is a timestamp, different in each process)")
    handler = logging.FileHandler(Path(run_dir) / f"rank{rank}.log")
    handler.setFormatter(logging.Formatter(f"%(asctime)s rank{rank} %(levelname)s %(name)s: %(message)s"))
    logging.getLogger("prmppo").addHandler(handler)
    log.info("rank %d of %d on %s (%s), pid %d", rank, ranks.world_size, device, dist.get_backend(), os.getpid())
    return ranks


def close_ranks(ranks) -> None:
    if isinstance(ranks, TorchRanks) and dist.is_initialized():
        dist.destroy_process_group()
