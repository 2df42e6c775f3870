"""What the PPO loop asks of its training ranks, answered for one process or for N under torchrun.

Data layout (`TorchRanks`): rank 0 samples (it alone talks to the rollout worker) and broadcasts
the whole batch; every rank scores it and holds the whole assembled batch, so global statistics
(loss denominators, whitening, group baselines, PopArt return statistics) are computed from the
same tensors on every rank, with no reduction to get wrong. The forward passes are split: each
rank takes a contiguous block of the rows (`local_rows`), and the no-grad results are gathered
back (`gather_rows`). Gradients of FSDP2-sharded parameters are summed by FSDP's reduce-scatter
(`shard.py` sets a divide factor of 1: each rank's loss is already its share of the global mean);
the replicated value head's gradients are summed here (`sum_grads`).
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

    def local_rows(self, n: int) -> torch.Tensor:
        return torch.arange(n)

    def gather_rows(self, tensor: torch.Tensor | None, n: int) -> torch.Tensor | None:
        return tensor

    def sum_floats(self, values: dict[str, float]) -> dict[str, float]:
        return values

    def sum_grads(self, params: list[nn.Parameter]) -> None:
        return None

    def from_main(self, make: Callable):
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

    def _blocks(self, n: int) -> list[torch.Tensor]:
        return list(torch.arange(n).tensor_split(self.world_size))  # contiguous, sizes differ by <= 1

    def local_rows(self, n: int) -> torch.Tensor:
        """This rank's contiguous block of `n` rows (rank 0 the first)."""
        return self._blocks(n)[self.rank]

    def gather_rows(self, tensor: torch.Tensor | None, n: int) -> torch.Tensor | None:
        """Every rank's `local_rows(n)` results [b_r, ...] concatenated in rank order: [n, ...]."""
        if tensor is None:
            return None
        sizes = [len(block) for block in self._blocks(n)]
        padded = torch.zeros((max(sizes), *tensor.shape[1:]), dtype=tensor.dtype, device=tensor.device)
        padded[: len(tensor)] = tensor
        parts = [torch.empty_like(padded) for _ in range(self.world_size)]
        dist.all_gather(parts, padded)
        return torch.cat([part[:size] for part, size in zip(parts, sizes)])

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

    def any(self, flag: bool) -> bool:
        """True on every rank when any rank says so (a stop request must be agreed on)."""
        value = torch.tensor([float(flag)], device=self.device)
        dist.all_reduce(value, op=dist.ReduceOp.MAX)
        return bool(value.item())

    def barrier(self) -> None:
        dist.barrier()
