"""A LoRA linear layer as one matmul (`ppo.fused_lora`).

peft's LoRA `Linear` computes `base(x) + lora_B(lora_A(x)) * s`: the base output and the branch's output are
each written in full ([tokens, out]) and read back by the add, and in backward the output gradient is read
once more for the branch (`dy @ B`). At the hidden sizes of small models (Qwen2-0.5B: 896) those passes over
[tokens, out] tensors cost about as much as the base matmul itself. Here the branch joins the base matmul:

    u = s * (x A^T)                       [tokens, r]
    y = [x, u] [W, B]^T + b               one matmul of inner size in + r, written once

and backward takes the input's and u's gradients from one matmul too (`dy [W, B]` = [dy W, dy B]), then
dA = (s * dy B)^T x, dB = dy^T u, dx = dy W + s * (dy B) A. W and b get gradients only when they require them
(frozen under LoRA: no weight-sized gradient is ever computed for them). [W, B] is made again in backward
rather than kept from forward, so no second copy of a layer's weights lives between the two.

`fuse_lora_linears(model)` gives every peft LoRA `Linear` of `model` this forward; a call it does not cover
runs peft's own forward unchanged: adapters disabled (the reference policy) or merged, mixed-batch
`adapter_names`, more than one active adapter, a LoRA variant (DoRA), dropout that is active, autocast, or
inputs and weights of different dtypes.

Tests: `pytest tests/models/test_lora_matmul.py -q`.
"""

from __future__ import annotations

import types

import torch
import torch.nn.functional as F
from torch import nn

try:  # peft's LoRA Linear: its own forward is what every uncovered call runs
    from peft.tuners.lora.layer import Linear as PeftLoraLinear
except ImportError:  # pragma: no cover - peft is a dependency
    PeftLoraLinear = None


class LoraMatmul(torch.autograd.Function):
    """y = [x, s * x A^T] [W, B]^T + bias, with the gradients of x, A and B (and of W and bias when they
    require one). x [..., in], weight W [out, in], bias [out] or None, lora_a A [r, in], lora_b B [out, r]."""

    @staticmethod
    def forward(ctx, x, weight, bias, lora_a, lora_b, scale: float):
        u = F.linear(x, lora_a) * scale  # [..., r]
        y = F.linear(torch.cat([x, u], dim=-1), torch.cat([weight, lora_b], dim=1), bias)  # [..., out]
        ctx.save_for_backward(x, weight, lora_a, lora_b, u)
        ctx.scale, ctx.has_bias = scale, bias is not None
        return y

    @staticmethod
    def backward(ctx, dy):
        x, weight, lora_a, lora_b, u = ctx.saved_tensors
        n_in = x.shape[-1]
        both = torch.matmul(dy, torch.cat([weight, lora_b], dim=1))  # [..., in + r]: [dy W, dy B]
        du = both[..., n_in:] * ctx.scale  # [..., r] the gradient of x A^T
        dx = both[..., :n_in] + torch.matmul(du, lora_a)  # [..., in]
        x2, dy2, du2 = x.reshape(-1, n_in), dy.reshape(-1, dy.shape[-1]), du.reshape(-1, du.shape[-1])
        d_a = du2.t() @ x2  # [r, in]
        d_b = dy2.t() @ u.reshape(-1, u.shape[-1])  # [out, r]
        d_w = dy2.t() @ x2 if ctx.needs_input_grad[1] else None
        d_bias = dy2.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return dx, d_w, d_bias, d_a, d_b, None


def _fused_forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    """The forward `fuse_lora_linears` gives a peft LoRA Linear: `LoraMatmul` where it applies, else peft's."""
    if args or kwargs or self.disable_adapters or self.merged:
        return PeftLoraLinear.forward(self, x, *args, **kwargs)
    active = [name for name in self.active_adapters if name in self.lora_A]
    if len(active) != 1 or active[0] in self.lora_variant:
        return PeftLoraLinear.forward(self, x, *args, **kwargs)
    name = active[0]
    dropout, base = self.lora_dropout[name], self.base_layer
    lora_a, lora_b = self.lora_A[name].weight, self.lora_B[name].weight
    weight, bias = base.weight, base.bias
    if (not isinstance(dropout, nn.Identity) and dropout.training) or torch.is_autocast_enabled(x.device.type) \
            or not (x.dtype == weight.dtype == lora_a.dtype == lora_b.dtype) \
            or (bias is not None and bias.dtype != x.dtype):
        return PeftLoraLinear.forward(self, x, *args, **kwargs)
    return LoraMatmul.apply(x, weight, bias, lora_a, lora_b, float(self.scaling[name]))


def fuse_lora_linears(model: nn.Module) -> int:
    """Give every peft LoRA `Linear` in `model` the one-matmul forward (module docstring); the number of them.
    Idempotent."""
    count = 0
    for module in model.modules():
        if PeftLoraLinear is not None and type(module) is PeftLoraLinear:
            module.forward = types.MethodType(_fused_forward, module)
            count += 1
    return count


def is_fused(module: nn.Module) -> bool:
    """Whether `fuse_lora_linears` gave `module` its forward."""
    forward = module.__dict__.get("forward")
    return getattr(forward, "__func__", None) is _fused_forward
