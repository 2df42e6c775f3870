"""What the PPO loop asks of its training ranks, answered for one process or for N under torchrun.

Data layout (`TorchRanks`): rank 0 samples (it alone talks to the rollout worker) and broadcasts
the whole batch; every rank scores it and holds the whole assembled batch, so global statistics
(loss denominators, whitening, group baselines, PopArt return statistics) are computed from the
same tensors on every rank, with no reduction to get wrong. The forward passes are split by the
update's plan (`ppo/batch.py plan_update`, the same on every rank): the micro-batches of each
minibatch are dealt to the ranks in turn (`deal`: micro-batch i to rank i % N), padded so that
every rank takes the same number of turns; in a turn without rows a rank still runs a forward (and
backward) whose result it discards (`idle_pass`), because FSDP's all-gathers and reduce-scatters
must meet on every rank. The no-grad results, each rank's rows filled and the rest 0, are summed
over the ranks (`sum_rows`): the rows are disjoint, so the sum gathers them exactly. Gradients of
FSDP2-sharded parameters are summed by FSDP's reduce-scatter (`shard.py` sets a divide factor of
1: each rank's loss is already its share of the global mean); the replicated value head's
gradients are summed here (`sum_grads`).

Beyond the loop's collectives, the stages ask the ranks object for what differs between one
process and N, instead of asking which one it is: `sharded`, `load_for_training` (fp32 masters
under FSDP2), `shard` / `shard_policy` (and a `full()` that gathers the full weights to rank 0),
`weight_sync` and `checkpoints` (their N-rank versions around the one-process ones), `main_metrics`
and `main_engine` (what rank 0 alone owns), `publish` (rank 0 writes while the others wait) and
`barrier`. `OneProcess` answers each with the plain one-process thing.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable, ClassVar

import torch
import torch.distributed as dist
from torch import nn

from prmppo.distributed.checkpoint import ShardedCheckpoints
from prmppo.distributed.shard import (GatheredModel, GatheredSync, GatheredWriter, check_identical_init,
                                      check_same_weights, shard_model, shard_policy)
from prmppo.logger import DiscardMetrics
from prmppo.models.loading import load_model


def _as_float(value) -> float:
    """A scalar that may be a DTensor (FSDP2's clip_grad_norm_ returns a replicated one)."""
    full = getattr(value, "full_tensor", None)
    return float(full() if full is not None else value)


class NoEngine:
    """The rollout worker as the ranks other than 0 see it: rank 0 alone starts it and asks it for batches."""

    def launch(self) -> None:
        return None

    def wait_ready(self) -> None:
        return None

    def close(self) -> None:
        return None

    def __enter__(self) -> "NoEngine":
        return self

    def __exit__(self, *exc_info) -> None:
        return None


@dataclass(frozen=True)
class OneProcess:
    """The single-process answers: every row is this process's, every sum is already global, every
    model is trained whole and written where it is."""

    device: torch.device
    rank: int = 0
    world_size: int = 1
    is_main: bool = True
    sharded: ClassVar[bool] = False  # whether the models trained here are split across ranks (FSDP2)

    def load_for_training(self, model_dir: Path, dtype: str) -> nn.Module:
        """The model at `model_dir` on this rank's device, in the dtype its training keeps (`model.dtype`)."""
        return load_model(model_dir, dtype, self.device)

    def shard(self, model: nn.Module, compute_dtype: torch.dtype,
              also_check: tuple[nn.Module, ...] = ()) -> Callable[[], nn.Module | None]:
        """Make `model` ready to train on these ranks (`also_check`: modules every rank must hold the same,
        like a replicated head); returns `full()`, the model with its full current weights on rank 0 (None
        elsewhere; a collective under several ranks). One process: nothing to do, `full()` is the model."""
        return lambda: model

    def shard_policy(self, policy, compute_dtype: torch.dtype) -> Callable:
        """`shard` for a PPO policy (its model, a separate reference, its value head); `full()` gives the
        policy holding the full weights on rank 0."""
        return lambda: policy

    def weight_sync(self, make_sync: Callable, full_policy: Callable, every_iterations: int):
        """The weight sync of this rank: `make_sync()` (a `WeightSync`, rank 0's only under several ranks)."""
        return make_sync()

    def checkpoints(self, local):
        """The checkpoint store of this rank: `local` (the one-process store) itself."""
        return local

    def main_metrics(self, open_metrics: Callable):
        """The stage's metrics logger: `open_metrics()` on rank 0, one that drops every row elsewhere."""
        return open_metrics() if self.is_main else DiscardMetrics()

    def main_engine(self, make: Callable):
        """The rollout worker client: `make()` on rank 0, which alone asks for batches; `NoEngine` elsewhere."""
        return make() if self.is_main else NoEngine()

    def publish(self, full: Callable, write: Callable) -> None:
        """`write(full())` on rank 0 (e.g. an artifact's files); every rank joins `full()` (a gather under
        several ranks) and returns once rank 0 has written."""
        model = full()
        if self.is_main:
            write(model)
        self.barrier()

    def deal(self, items: list) -> list:
        return list(items)

    def idle_pass(self, run: Callable) -> None:
        return None  # one process: a turn without rows is simply skipped

    def sum_rows(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    def sum_floats(self, values: dict[str, float]) -> dict[str, float]:
        return values

    def sum_grads(self, params: list[nn.Parameter]) -> None:
        return None

    def from_main(self, make: Callable):
        return make()

    def main_first(self, make: Callable):
        return make()

    def any(self, flag: bool) -> bool:
        return flag

    def scalar(self, value) -> float:
        return _as_float(value)

    def barrier(self) -> None:
        return None


@dataclass(frozen=True)
class TorchRanks(OneProcess):
    """N processes of one torch.distributed process group (made by `launch.init_ranks`)."""

    rank: int = 0
    world_size: int = 1
    is_main: bool = True
    sharded: ClassVar[bool] = True

    def load_for_training(self, model_dir: Path, dtype: str) -> nn.Module:
        """In fp32 whatever `dtype` says: FSDP2's sharded weights are the master weights, and it computes in
        `dtype` over them (`shard`)."""
        return load_model(model_dir, "float32", self.device)

    def shard(self, model: nn.Module, compute_dtype: torch.dtype,
              also_check: tuple[nn.Module, ...] = ()) -> Callable[[], nn.Module | None]:
        """Refuse ranks that start from different weights, keep rank 0's plain copy (made before sharding),
        shard `model` per decoder block and at the root (`shard.py`)."""
        check_same_weights([model, *also_check], self)
        gathered = GatheredModel(model, self)
        shard_model(model, compute_dtype)
        return gathered.full

    def shard_policy(self, policy, compute_dtype: torch.dtype) -> Callable:
        check_identical_init(policy, self)
        writer = GatheredWriter(policy, self)  # its plain copy is made before sharding
        shard_policy(policy, compute_dtype)  # fp32 weights, compute in compute_dtype
        return writer.full_policy

    def weight_sync(self, make_sync: Callable, full_policy: Callable, every_iterations: int):
        """Every rank joins the gather on the sync cadence; rank 0 writes and serves (`GatheredSync`)."""
        return GatheredSync(make_sync() if self.is_main else None, full_policy, every_iterations)

    def checkpoints(self, local):
        """Sharded checkpoints (`distributed/checkpoint.py`) in place of the one-process store."""
        return ShardedCheckpoints(self)

    def deal(self, items: list) -> list:
        """This rank's turns of `items` (the micro-batches of one minibatch): item i goes to rank i % N,
        and a rank with fewer items than the most any rank has gets None for each missing turn."""
        turns = -(-len(items) // self.world_size)  # ceil: the turns every rank takes
        mine = list(items[self.rank::self.world_size])
        return mine + [None] * (turns - len(mine))

    def idle_pass(self, run: Callable) -> None:
        """`run()` for a turn without rows: its forwards (and backward) meet the other ranks' collectives."""
        run()

    def sum_rows(self, tensor: torch.Tensor) -> torch.Tensor:
        """[n, ...] summed over the ranks: each rank filled its own rows and left the others 0."""
        total = tensor.clone()
        dist.all_reduce(total)
        return total

    def sum_floats(self, values: dict[str, float]) -> dict[str, float]:
        """Each value summed over the ranks (every rank must pass the same keys)."""
        keys = sorted(values)
        total = torch.tensor([float(values[k]) for k in keys], dtype=torch.float64, device=self.device)
        dist.all_reduce(total)
        return dict(zip(keys, total.tolist()))

    def sum_grads(self, params: list[nn.Parameter]) -> None:
        """Sum the gradients of parameters every rank holds whole (the value head) over the ranks."""
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)  # a rank without a contribution still joins the sum
            dist.all_reduce(p.grad)

    def from_main(self, make: Callable):
        """`make()` run on rank 0 alone (e.g. the rollout request), its result sent to every rank."""
        box = [make() if self.is_main else None]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def main_first(self, make: Callable):
        """`make()` on rank 0, then on the other ranks (e.g. a model directory rank 0 writes and they read)."""
        result = make() if self.is_main else None
        dist.barrier()
        return result if self.is_main else make()

    def any(self, flag: bool) -> bool:
        """True on every rank when any rank says so (a stop request must be agreed on)."""
        value = torch.tensor([float(flag)], device=self.device)
        dist.all_reduce(value, op=dist.ReduceOp.MAX)
        return bool(value.item())

    def barrier(self) -> None:
        dist.barrier()
