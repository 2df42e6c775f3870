"""The static decoder's decode step with its decoder layers compiled (`rollout.compile_decode=true`).

In a decode step of 2 rows or more, every decoder layer of the model runs one `torch.compile` graph of the
layer's forward (`layer_step`), the same graph for every layer: the layer's KV buffers come in as arguments,
behind a `LayerSlotCache` that writes them whatever layer index the attention passes, so the graph depends
on no layer's identity; the batch and the cache's slot count are marked dynamic, so it serves every bucket
and request length. The rest of the step (embeddings, rotary tables, the final norm, the head) runs eagerly;
on CUDA the step's CUDA graph captures both, so the eager kernels cost no launches at replay.

One layer is traced, not the whole model: dynamo traces at every start-up, warm compile cache or not (the
caches hold what inductor and AOTAutograd make from a traced graph), and a whole Qwen2-0.5B forward took 8 s
of tracing on an H200 against under a second for a layer.

The model's own forward calls each layer as usual; `layer_calls` installs, for the block, a
`_compiled_call_impl` on each layer (the hook `nn.Module.compile` uses) that swaps the step's whole-model
cache for the layer's own buffers and calls the compiled graph.

Run the tests: `PYTHONPATH=src pytest tests/rollout/test_static_decode.py -q -k compiled`.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

COMPILE_BACKEND = "inductor"  # of `compiled_layer_step`
_COMPILED_LAYER_STEP = None


class LayerSlotCache:
    """One decoder layer's KV buffers keys/values [b, H_kv, S, d], written at `slots` [q]: duck-typed to the part
    of transformers' `Cache` an attention layer calls (`update`), blind to the layer index it is given."""

    is_compileable = True

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, slots: torch.Tensor) -> None:
        self.keys, self.values, self.slots = keys, values, slots

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        self.keys.index_copy_(2, self.slots, key_states.to(self.keys.dtype))
        self.values.index_copy_(2, self.slots, value_states.to(self.values.dtype))
        return self.keys, self.values

    def get_seq_length(self, layer_idx: int = 0) -> int:
        raise RuntimeError("this transformers asks the KV cache for its length inside a decoder layer, which the "
                           "compiled decode step does not pass (it would recompile every step): use "
                           "rollout.compile_decode=false")


def layer_step(layer: nn.Module, cache_kwarg: str, keys: torch.Tensor, values: torch.Tensor, slots: torch.Tensor,
               args: tuple, kwargs: dict):
    """`layer`'s forward on the model's arguments `args`/`kwargs`, its cache (`cache_kwarg`) its own buffers."""
    return layer.forward(*args, **{**kwargs, cache_kwarg: LayerSlotCache(keys, values, slots)})


def compiled_layer_step():
    """`layer_step` under `torch.compile` (one per process: dynamo keeps its graphs by code object, so every
    layer and every decoder of the process share them)."""
    global _COMPILED_LAYER_STEP
    if _COMPILED_LAYER_STEP is None:
        # the layers' float constants (norm epsilons, LoRA scalings) as constants, as the trainer's compiled
        # layers have them (`models/policy.py compile_decoder_layers`): symbolic, they restart dynamo's analysis
        torch._dynamo.config.specialize_float = True
        _COMPILED_LAYER_STEP = torch.compile(layer_step, backend=COMPILE_BACKEND)
    return _COMPILED_LAYER_STEP


def decoder_layers(model: nn.Module) -> nn.ModuleList | None:
    """The decoder layers of a transformers causal LM (`get_decoder().layers`), or None where it has no such list."""
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
    layers = getattr(decoder, "layers", None)
    return layers if isinstance(layers, nn.ModuleList) and len(layers) else None


class _LayerCall:
    """A decoder layer's call during a compiled decode step: the model passes the step's whole-model cache
    (`cache`, a `static_decode.SlotCache`); the layer's graph gets the layer's own buffers instead."""

    def __init__(self, layer: nn.Module, keys: torch.Tensor, values: torch.Tensor, slots: torch.Tensor,
                 cache) -> None:
        self.layer, self.keys, self.values, self.slots, self.cache = layer, keys, values, slots, cache

    def __call__(self, *args, **kwargs):
        names = [name for name, value in kwargs.items() if value is self.cache]
        if len(names) != 1:
            raise RuntimeError(f"{type(self.layer).__name__} was called without the decode step's KV cache as a "
                               f"keyword argument (keywords: {sorted(kwargs)}): this transformers is not one the "
                               f"compiled decode step knows; use rollout.compile_decode=false")
        rest = {name: value for name, value in kwargs.items() if name != names[0]}
        rows, slots = self.keys.shape[0], self.keys.shape[2]
        for tensor in (*args, *rest.values(), *rest.get("position_embeddings", ())):
            if isinstance(tensor, torch.Tensor) and tensor.dim() and tensor.shape[0] == rows:
                torch._dynamo.maybe_mark_dynamic(tensor, 0)  # the bucket
        for tensor in (self.keys, self.values):  # [b, H_kv, S, d]
            torch._dynamo.maybe_mark_dynamic(tensor, 0)
            torch._dynamo.maybe_mark_dynamic(tensor, 2)
        mask = rest.get("attention_mask")
        if isinstance(mask, torch.Tensor) and mask.shape[-1] == slots:  # [b, 1, q, S]
            torch._dynamo.maybe_mark_dynamic(mask, mask.dim() - 1)
        return compiled_layer_step()(self.layer, names[0], self.keys, self.values, self.slots, args, rest)


@contextlib.contextmanager
def layer_calls(layers: nn.ModuleList, keys: list[torch.Tensor], values: list[torch.Tensor], slots: torch.Tensor,
                cache):
    """For the block, layer i of `layers` runs the compiled `layer_step` on keys[i]/values[i] when the model's
    forward calls it with `cache`; each layer's own `_compiled_call_impl` is restored after."""
    saved = [layer._compiled_call_impl for layer in layers]
    for layer, layer_keys, layer_values in zip(layers, keys, values, strict=True):
        layer._compiled_call_impl = _LayerCall(layer, layer_keys, layer_values, slots, cache)
    try:
        yield
    finally:
        for layer, call in zip(layers, saved):
            layer._compiled_call_impl = call
