"""The optimisation helpers SFT, PRM and PPO share: AdamW, the warmup-cosine LR schedule, fp32 masters.

`adamw` builds AdamW without weight decay, with torch's fused CUDA kernel when the parameters live
on a GPU (the same AdamW update, one launch per step). `warmup_cosine` / `make_scheduler` give the
learning-rate shape every stage trains with: linear warmup, then cosine down to a floor.

fp32 master weights for parameters trained in half precision: AdamW applied directly to a bf16
weight loses most small updates (bf16 keeps 8 bits of mantissa, so an update below ~1/256 of the
weight rounds away; at lr 1e-5 most of a bf16 weight never changes). `MasterWeights` keeps an fp32
copy of every trainable bf16/fp16 parameter (full fine-tuning's weights; under LoRA the factors and
`modules_to_save`, which `LoraPolicy` keeps in the model's dtype so that its layers run bf16
GEMMs); the optimizer steps the copies and the model's parameter receives the rounded result.
Parameters already in fp32 pass through untouched, so on an fp32 model this is a no-op.

    masters = MasterWeights(param_groups)            # build the optimizer on masters.groups
    loss.backward(); masters.grads_to_masters()      # fp32 grads (clip these)
    optimizer.step(); masters.masters_to_model()

The other way to train in bf16 is `ppo.autocast=bfloat16` on fp32 weights: the weights are then
the masters and there is nothing to copy.

Tests: `pytest tests/test_optim.py -q`.
"""

from __future__ import annotations

import functools
import math

import torch
from torch import nn
from torch.distributed.tensor import DTensor

LOW_PRECISION = (torch.bfloat16, torch.float16)
AUTOCAST_MODES = ("none", "bfloat16")  # ppo.autocast


def adamw(params, lr: float, betas: tuple[float, float]) -> torch.optim.AdamW:
    """AdamW without weight decay on `params` (tensors or groups); fused when they are on CUDA."""
    groups = list(params)
    tensors = [p for g in groups for p in (g["params"] if isinstance(g, dict) else [g])]
    on_cuda = bool(tensors) and all(p.is_cuda for p in tensors)
    return torch.optim.AdamW(groups, lr=lr, betas=betas, weight_decay=0.0, fused=True if on_cuda else None)


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's shard on this rank (a view of its storage); any other tensor as it is."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


class MasterWeights:
    """fp32 copies of the low-precision parameters of `param_groups` (dicts with "params")."""

    def __init__(self, param_groups: list[dict]):
        self.pairs: list[tuple[nn.Parameter, torch.Tensor]] = []  # (model parameter, its fp32 master)
        self.groups: list[dict] = []
        for group in param_groups:
            params = []
            for p in group["params"]:
                if p.dtype in LOW_PRECISION:
                    master = nn.Parameter(p.detach().float().clone())
                    self.pairs.append((p, master))
                    params.append(master)
                else:
                    params.append(p)
            self.groups.append({**group, "params": params})

    def parameters(self) -> list[torch.Tensor]:
        """What the optimizer steps (and what to clip): masters and fp32 parameters."""
        return [p for group in self.groups for p in group["params"]]

    def grads_to_masters(self) -> None:
        for p, master in self.pairs:
            master.grad = None if p.grad is None else p.grad.float()
            p.grad = None

    @torch.no_grad()
    def masters_to_model(self) -> None:
        """One multi-tensor launch (rounding to the model's dtype as `copy_` does), not one per tensor. FSDP2's
        parameters are DTensors, for which torch registers no foreach copy: they copy shard to shard (a master
        has its parameter's sharding)."""
        if self.pairs:
            torch._foreach_copy_([_local(p) for p, _ in self.pairs], [_local(master) for _, master in self.pairs])

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {str(i): master.detach().cpu() for i, (_, master) in enumerate(self.pairs)}

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        if len(state) != len(self.pairs):
            raise ValueError(f"the checkpoint holds {len(state)} fp32 master weights but this policy trains "
                             f"{len(self.pairs)} half-precision parameters")
        for i, (p, master) in enumerate(self.pairs):
            master.copy_(state[str(i)])
            p.copy_(master)


def warmup_cosine(step: int, total_steps: int, warmup_steps: int, min_ratio: float) -> float:
    """LR multiplier at optimizer step `step` (0-based) of `total_steps`.

    Warmup: step in [0, warmup_steps) -> (step + 1) / warmup_steps, reaching 1 on its last step.
    Then cosine from 1 (at step = warmup_steps) down to `min_ratio` exactly at step
    total_steps - 1; when that phase has a single step, it is at min_ratio. Steps past the
    end return min_ratio (LambdaLR evaluates one step past the last optimizer step).
    """
    if total_steps < 1:
        raise ValueError(f"total_steps={total_steps!r} is invalid; it must be >= 1")
    if not 0 <= warmup_steps <= total_steps:
        raise ValueError(f"warmup_steps={warmup_steps!r} is invalid; it must lie in "
                         f"[0, total_steps={total_steps}]")
    if not 0.0 <= min_ratio <= 1.0:
        raise ValueError(f"min_ratio={min_ratio!r} is invalid; it must lie in [0, 1]")
    if step < 0:
        raise ValueError(f"step={step!r} is invalid; it must be >= 0")
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if step >= total_steps:
        return min_ratio
    decay_steps = total_steps - 1 - warmup_steps
    progress = (step - warmup_steps) / decay_steps if decay_steps > 0 else 1.0
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def make_scheduler(optimizer: torch.optim.Optimizer, total_steps: int, warmup_steps: int,
                   min_ratio: float) -> torch.optim.lr_scheduler.LambdaLR:
    """LambdaLR applying `warmup_cosine`; call `.step()` once per optimizer step."""
    warmup_cosine(0, total_steps, warmup_steps, min_ratio)  # refuse bad arguments now
    schedule = functools.partial(warmup_cosine, total_steps=total_steps,
                                 warmup_steps=warmup_steps, min_ratio=min_ratio)
    return torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
