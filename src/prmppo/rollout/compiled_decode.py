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

Fused projections: for the decoder layers of the Llama family (Llama, Mistral, Qwen2) the step runs the
layer's own forward rewritten around two wide matmuls (`fused_layer_forward`): the query, key and value
projections as one matmul against their weights stacked [q; k; v], and the MLP's gate and up projections as one
against [gate; up]. At a decode step's few hundred rows each projection is a small matmul whose time is mostly
fixed cost (on an H100 at 256 rows and the Qwen2-0.5B shape, 6.4 us for a key projection of 0.23 MB of weights,
7.2 us for the query's 1.6 MB), so three become one. The stacked weights are copies (`FusedProjections`, made
with the decoder and refreshed from the layers at the start of every request, so that a decoder kept across
requests never samples with stale weights); a projection with a LoRA branch running (an unmerged adapter) is
not a plain matmul, and the step then runs the layer's own forward.

Run the tests: `PYTHONPATH=src pytest tests/rollout/test_static_decode.py -q -k compiled`.
"""

from __future__ import annotations

import contextlib
import sys

import torch
import torch.nn.functional as F
from torch import nn

from prmppo.rollout import grouped_attention

COMPILE_BACKEND = "inductor"  # of `compiled_layer_step`
_COMPILED_LAYER_STEP = None
FUSE_PROJECTIONS = True  # Llama-family layers run `fused_layer_forward` where they can
FUSED_LAYER_CLASSES = ("LlamaDecoderLayer", "MistralDecoderLayer", "Qwen2DecoderLayer")


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
               args: tuple, kwargs: dict, fused: tuple | None = None):
    """`layer`'s forward on the model's arguments `args`/`kwargs`, its cache (`cache_kwarg`) its own buffers;
    with `fused` (the layer's entry of `FusedProjections.weights`), `fused_layer_forward` instead."""
    if fused is not None:
        hidden = args[0] if args else kwargs["hidden_states"]
        return fused_layer_forward(layer, hidden, kwargs.get("attention_mask"), kwargs["position_embeddings"],
                                   keys, values, slots, *fused)
    return layer.forward(*args, **{**kwargs, cache_kwarg: LayerSlotCache(keys, values, slots)})


def fused_layer_forward(layer: nn.Module, hidden: torch.Tensor, attention_mask, position_embeddings: tuple,
                        keys: torch.Tensor, values: torch.Tensor, slots: torch.Tensor, qkv_weight: torch.Tensor,
                        qkv_bias, gate_up_weight: torch.Tensor, gate_up_bias, rotary) -> torch.Tensor:
    """A Llama-family decoder layer's forward (pre-norm attention and gated MLP, each around a residual) on
    hidden [b, q, D], with its key/value buffers [b, H_kv, S, d] written at `slots` [q] and the grouped
    attention over them; the q/k/v projections as one matmul against `qkv_weight` [(H + 2 H_kv) d, D] and the
    gate/up projections as one against `gate_up_weight` [2 I, D]; `rotary` is the model's own
    `apply_rotary_pos_emb`. Returns the layer's output hidden states [b, q, D]."""
    attn, mlp = layer.self_attn, layer.mlp
    batch, q_length, _ = hidden.shape
    head_dim, kv_heads = keys.shape[3], keys.shape[1]
    normed = layer.input_layernorm(hidden)
    query, key, value = F.linear(normed, qkv_weight, qkv_bias).split(
        [qkv_weight.shape[0] - 2 * kv_heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    query = query.view(batch, q_length, -1, head_dim).transpose(1, 2)  # [b, H, q, d]
    key = key.view(batch, q_length, kv_heads, head_dim).transpose(1, 2)  # [b, H_kv, q, d]
    value = value.view(batch, q_length, kv_heads, head_dim).transpose(1, 2)
    cos, sin = position_embeddings
    query, key = rotary(query, key, cos, sin)
    keys.index_copy_(2, slots, key.to(keys.dtype))
    values.index_copy_(2, slots, value.to(values.dtype))
    attended, _ = grouped_attention.grouped_attention_forward(attn, query, keys, values, attention_mask,
                                                              scaling=attn.scaling)  # [b, q, H, d]
    hidden = hidden + attn.o_proj(attended.reshape(batch, q_length, -1))
    gate, up = F.linear(layer.post_attention_layernorm(hidden), gate_up_weight, gate_up_bias).chunk(2, dim=-1)
    return hidden + mlp.down_proj(mlp.act_fn(gate) * up)


def _plain_linear(module: nn.Module) -> nn.Linear | None:
    """The nn.Linear whose weight and bias `module` applies as it is now: `module` itself, or a LoRA layer's base
    layer while its LoRA branches are off (merged or disabled); None when it computes anything else."""
    if type(module) is nn.Linear:
        return module
    base = module.get_base_layer() if hasattr(module, "get_base_layer") else None
    if type(base) is nn.Linear and (getattr(module, "disable_adapters", False) or getattr(module, "merged", False)):
        return base
    return None


FUSED_GROUPS = (("self_attn", ("q_proj", "k_proj", "v_proj")), ("mlp", ("gate_proj", "up_proj")))


def _fused_groups(layer: nn.Module) -> list[list[nn.Linear | None]]:
    """The plain linears (`_plain_linear`) of each group of `FUSED_GROUPS` in `layer`, in stacking order."""
    return [[_plain_linear(getattr(getattr(layer, owner), name)) for name in names] for owner, names in FUSED_GROUPS]


def fusion_refusal(layer: nn.Module) -> str | None:
    """Why `fused_layer_forward` cannot stand in for `layer`'s forward as the layer is now; None when it can."""
    name = type(layer).__name__
    if name not in FUSED_LAYER_CLASSES:
        return f"{name} is not one of {FUSED_LAYER_CLASSES}"
    if getattr(layer.self_attn, "sliding_window", None) is not None:
        return "sliding-window attention"
    if not hasattr(sys.modules.get(type(layer).__module__), "apply_rotary_pos_emb"):
        return f"{type(layer).__module__} has no apply_rotary_pos_emb"
    for (_, group), linears in zip(FUSED_GROUPS, _fused_groups(layer)):
        if any(linear is None for linear in linears):
            return f"{group} are not all plain linears (a LoRA branch runs unmerged)"
        if len({(linear.weight.dtype, linear.weight.device, linear.in_features) for linear in linears}) > 1:
            return f"{group} differ in dtype, device or input size"
        if len({linear.bias is None for linear in linears}) > 1:
            return f"{group} have a bias in some projections only"
    return None


class FusedProjections:
    """Stacked copies of the q/k/v and gate/up weights of `layers`, for `fused_layer_forward`. `refresh` copies
    the layers' weights as they are into them, in place (a captured CUDA graph reads these addresses)."""

    def __init__(self, layers: nn.ModuleList) -> None:
        self.layers = layers
        self.weights: list[tuple] | None = None  # per layer: (qkv weight, qkv bias, gate/up weight, bias, rotary)
        self.version = 0  # counts the changes of `weights`' tensors (a CUDA graph captured before reads old ones)

    def refresh(self) -> str | None:
        """Bring the stacked weights up to the layers' current ones; returns why the layers cannot run fused (and
        leaves no weights) or None."""
        reasons = {reason for reason in map(fusion_refusal, self.layers) if reason}
        if reasons:
            self.version += self.weights is not None
            self.weights = None
            return "; ".join(sorted(reasons))
        stacked = []
        for index, layer in enumerate(self.layers):
            parts = []
            for position, linears in enumerate(_fused_groups(layer)):
                for slot, attribute in enumerate(("weight", "bias")):
                    tensors = [getattr(linear, attribute) for linear in linears]
                    if tensors[0] is None:
                        parts.append(None)
                        continue
                    held = self.weights[index][2 * position + slot] if self.weights is not None else None
                    rows = sum(tensor.shape[0] for tensor in tensors)
                    if held is None or held.shape[0] != rows or held.dtype != tensors[0].dtype:
                        held = torch.cat([t.detach() for t in tensors])
                        self.version += 1
                    else:
                        torch.cat([t.detach() for t in tensors], out=held)
                    parts.append(held)
            stacked.append((*parts, sys.modules[type(layer).__module__].apply_rotary_pos_emb))
        self.weights = stacked
        return None


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
                 cache, fused: tuple | None = None) -> None:
        self.layer, self.keys, self.values, self.slots, self.cache = layer, keys, values, slots, cache
        self.fused = fused  # the layer's stacked projection weights (`FusedProjections`), or None

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
        fused = self.fused if "position_embeddings" in rest else None  # the rotary tables come from the model
        return compiled_layer_step()(self.layer, names[0], self.keys, self.values, self.slots, args, rest, fused)


@contextlib.contextmanager
def layer_calls(layers: nn.ModuleList, keys: list[torch.Tensor], values: list[torch.Tensor], slots: torch.Tensor,
                cache, fused: list[tuple] | None = None):
    """For the block, layer i of `layers` runs the compiled `layer_step` on keys[i]/values[i] (with fused[i], the
    layer's stacked projection weights, when given) when the model's forward calls it with `cache`; each layer's
    own `_compiled_call_impl` is restored after."""
    saved = [layer._compiled_call_impl for layer in layers]
    for index, (layer, layer_keys, layer_values) in enumerate(zip(layers, keys, values, strict=True)):
        layer._compiled_call_impl = _LayerCall(layer, layer_keys, layer_values, slots, cache,
                                               None if fused is None else fused[index])
    try:
        yield
    finally:
        for layer, call in zip(layers, saved):
            layer._compiled_call_impl = call
