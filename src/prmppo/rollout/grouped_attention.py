"""Grouped-query attention that never expands keys and values: the static decoder's decode attention.

transformers' sdpa and eager attention, given a 4D mask, call `repeat_kv`: every layer of every
decode step copies the whole cache's keys and values from H_kv to H heads (Qwen2-0.5B: 2 -> 14,
over every slot of every row). At 256 rows that copy was half of the step's GPU time.

`grouped_attention_forward` instead folds the H / H_kv query heads of a group into the query
axis: query [b, H, q, d] -> [b, H_kv, g*q, d] (g = H / H_kv), and runs torch's
`scaled_dot_product_attention` with H_kv heads of g*q queries each over the keys and values
[b, H_kv, S, d] as they are, the mask broadcast over each group, and back to the [b, q, H, d]
transformers expects. On CUDA that is one fused kernel (memory-efficient or cuDNN attention; a mask
rules flash out): it reads each KV head once and never writes the scores [b, H, q, S], where two
batched matmuls around a softmax wrote them and read them back, in three launches. Fixed shapes
and no host syncs keep it capturable in a CUDA graph.

Simplifications: no dropout, no logit softcapping, no attention sinks, no position bias, and
q > 1 needs an explicit mask (no `is_causal`): it refuses those with an exception, and
`refusal` names the models that need them so the decoder keeps the model's own attention.

It is registered with transformers' `AttentionInterface` under `NAME` and selected only around
the static decoder's decode forwards (`attention_implementation`); every other forward of the
model, and every model of the trainer, keeps its own implementation.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

NAME = "prmppo_grouped"
REFUSED_KWARGS = ("softcap", "s_aux", "sinks", "position_bias")


def grouped_attention_forward(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                              attention_mask: torch.Tensor | None, dropout: float = 0.0,
                              scaling: float | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """Attention of query [b, H, q, d] over key/value [b, H_kv, S, d]; returns ([b, q, H, d], None).

    The signature is transformers' attention-function contract (`AttentionInterface`); `module` is
    the calling attention layer (unused), `attention_mask` is additive (float) or bool, shaped
    [b or 1, 1 or H, q, >= S].
    """
    refused = [name for name in REFUSED_KWARGS if kwargs.get(name) is not None]
    if refused or dropout:
        raise ValueError(f"{NAME} attention supports no {refused or ['dropout']} "
                         f"(got dropout={dropout}); use sdpa or eager for this model")
    batch, heads, q_length, head_dim = query.shape
    kv_heads, slots = key.shape[1], key.shape[2]
    if heads % kv_heads:
        raise ValueError(f"{heads} query heads are not a multiple of {kv_heads} key/value heads")
    if attention_mask is None and q_length > 1:
        raise ValueError(f"{NAME} attention needs an explicit mask for q={q_length} > 1 (it has no is_causal)")
    group = heads // kv_heads
    # head h = kv * group + j, as repeat_kv lays it out: the group's heads become query rows
    grouped = query.reshape(batch, kv_heads, group * q_length, head_dim)  # [b, H_kv, g*q, d]
    mask = None if attention_mask is None else _grouped_mask(attention_mask, kv_heads, group, slots, query.dtype)
    # one fused kernel on CUDA (memory-efficient or cuDNN attention: a mask rules flash out), H_kv heads each
    # with g*q queries: the keys and values are read once per KV head and the scores never reach memory
    output = F.scaled_dot_product_attention(grouped, key, value, attn_mask=mask, scale=scaling)  # [b, H_kv, g*q, d]
    return output.view(batch, heads, q_length, head_dim).transpose(1, 2).contiguous(), None  # [b, q, H, d]


def _grouped_mask(mask: torch.Tensor, kv_heads: int, group: int, slots: int, dtype) -> torch.Tensor:
    """A mask [b or 1, 1 or H, q, >= S] for the grouped queries: [b or 1, 1 or H_kv, g*q, S] (row j*q + i is
    query i of the group's head j), float in the queries' dtype or bool."""
    mask_batch, mask_heads, q_length, _ = mask.shape
    mask = mask[..., :slots]
    if mask_heads == 1:
        if q_length > 1:  # every head of the group sees query i's row ([b, 1, 1, S] broadcasts as it is)
            mask = mask[:, :, None].expand(mask_batch, 1, group, q_length, slots).reshape(mask_batch, 1, -1, slots)
    else:
        mask = mask.reshape(mask_batch, kv_heads, group * q_length, slots)
    return mask if mask.dtype == torch.bool else mask.to(dtype)


def refusal(model) -> str | None:
    """Why `grouped_attention_forward` cannot stand in for `model`'s attention; None when it can."""
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    if getattr(config, "attn_logit_softcapping", None) is not None:
        return f"attention logit softcapping {config.attn_logit_softcapping}"
    if any(hasattr(module, "sinks") for module in model.modules()):
        return "attention sinks"
    return None


def register() -> str | None:
    """Register `grouped_attention_forward` with transformers under `NAME` (idempotent: a dict
    entry); returns why it could not, or None."""
    try:
        from transformers import AttentionInterface

        AttentionInterface.register(NAME, grouped_attention_forward)
    except (ImportError, AttributeError) as err:
        return f"this transformers has no AttentionInterface.register ({err})"
    return None


@contextlib.contextmanager
def attention_implementation(model, name: str | None):
    """Run the block with `model`'s attention implementation set to `name` (None: leave it)."""
    if name is None:
        yield
        return
    previous = model.config._attn_implementation
    model.config._attn_implementation = name
    try:
        yield
    finally:
        model.config._attn_implementation = previous
