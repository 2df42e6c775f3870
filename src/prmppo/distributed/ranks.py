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
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist
from torch import nn


def _as_float(value) -> float:
    """A scalar that may be a DTensor (FSDP2's clip_grad_norm_ returns a replicated one)."""
    full = getattr(value, "full_tensor", None)
    return float(full() if full is not None else value)


@dataclass(frozen=True)
class OneProcess:
    """The single-process answers: every row is this process's, every sum is already global."""

    device: torch.device
    rank: int = 0
    world_size: int = 1
    is_main: bool = True

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
