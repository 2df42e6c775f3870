"""Grouped-query attention without K/V copies, against torch's sdpa over expanded K/V.

The reference is `F.scaled_dot_product_attention` with keys and values repeated to every query
head (what transformers' `repeat_kv` does), in float32: the two compute the same sums in another
order, so they agree to ~1e-6.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from prmppo.rollout import grouped_attention, static_decode
from prmppo.rollout.grouped_attention import grouped_attention_forward
from prmppo.rollout.hf_engine import HFEngine
from rollout.test_hf_engine import EOS, PAD, PROMPTS
from rollout.test_static_decode import save_tiny_qwen2


def attention_inputs(group: int, q_length: int, batch=3, kv_heads=2, slots=9, head_dim=8, seed=0):
    generator = torch.Generator().manual_seed(seed)
    query = torch.randn(batch, kv_heads * group, q_length, head_dim, generator=generator)  # [b, H, q, d]
    key = torch.randn(batch, kv_heads, slots, head_dim, generator=generator)  # [b, H_kv, S, d]
    value = torch.randn(batch, kv_heads, slots, head_dim, generator=generator)  # [b, H_kv, S, d]
    # row 0 sees every slot, row 1 is left-padded by 3 slots, row 2 sees only its last 2 slots
    keep = torch.ones(batch, 1, q_length, slots, dtype=torch.bool)  # [b, 1, q, S]
    keep[1, ..., :3] = False
    keep[2, ..., :slots - 2] = False
    return query, key, value, keep


def reference(query, key, value, keep, scaling):
    group = query.shape[1] // key.shape[1]
    expanded_key, expanded_value = key.repeat_interleave(group, 1), value.repeat_interleave(group, 1)
    out = F.scaled_dot_product_attention(query, expanded_key, expanded_value, attn_mask=keep, scale=scaling)
    return out.transpose(1, 2)  # [b, q, H, d]


@pytest.mark.parametrize("group", [1, 2, 7])
@pytest.mark.parametrize("q_length", [1, 4])
@pytest.mark.parametrize("mask_kind", ["additive", "bool"])
def test_equals_sdpa_on_expanded_key_values(group, q_length, mask_kind):
    query, key, value, keep = attention_inputs(group, q_length)
    additive = torch.zeros(keep.shape).masked_fill(~keep, torch.finfo(torch.float32).min)
    mask = additive if mask_kind == "additive" else keep
    got, weights = grouped_attention_forward(None, query, key, value, mask, dropout=0.0, scaling=0.3)
    assert weights is None and got.is_contiguous()
    torch.testing.assert_close(got, reference(query, key, value, keep, 0.3), atol=1e-6, rtol=1e-5)


def test_a_per_head_mask_and_the_default_scaling():
    query, key, value, keep = attention_inputs(group=3, q_length=2)
    per_head = keep.repeat(1, 6, 1, 1)  # [b, H, q, S]
    per_head[:, 4, :, 5] = False  # one head of the second group loses one slot
    got, _ = grouped_attention_forward(None, query, key, value, per_head)
    want = F.scaled_dot_product_attention(query, key.repeat_interleave(3, 1), value.repeat_interleave(3, 1),
                                          attn_mask=per_head).transpose(1, 2)  # default scale 1/sqrt(d)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)


class LargestTensor(TorchDispatchMode):
    """Records the largest number of elements of any tensor an op writes into new memory
    (a view shares its input's storage and makes none)."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {arg.untyped_storage().data_ptr() for arg in args if isinstance(arg, torch.Tensor)}
        for tensor in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(tensor, torch.Tensor) and tensor.untyped_storage().data_ptr() not in inputs:
                self.largest = max(self.largest, tensor.numel())
        return out


@pytest.mark.parametrize("mask_kind", ["additive", "bool"])
def test_decode_makes_no_tensor_of_the_expanded_key_or_the_scores_size(mask_kind):
    query, key, value, keep = attention_inputs(group=7, q_length=1, slots=64, head_dim=16)
    expanded = key.numel() * 7  # what repeat_kv makes, for keys and again for values
    scores = query.shape[0] * query.shape[1] * key.shape[2]  # [b, H, 1, S]
    mask = torch.zeros(keep.shape).masked_fill(~keep, -1e30) if mask_kind == "additive" else keep
    with LargestTensor() as grouped:
        got, _ = grouped_attention_forward(None, query, key, value, mask, scaling=0.25)
    with LargestTensor() as repeated:
        reference(query, key, value, keep, 0.25)
    assert repeated.largest >= expanded  # the check sees the copy when there is one
    assert grouped.largest == got.numel() < scores  # one fused op: the output [b, 1, H, d] is the largest tensor


def test_refuses_what_it_does_not_compute():
    query, key, value, keep = attention_inputs(group=2, q_length=3)
    with pytest.raises(ValueError, match="softcap"):
        grouped_attention_forward(None, query, key, value, keep, softcap=30.0)
    with pytest.raises(ValueError, match="dropout"):
        grouped_attention_forward(None, query, key, value, keep, dropout=0.1)
    with pytest.raises(ValueError, match="explicit mask"):
        grouped_attention_forward(None, query, key, value, None)
    with pytest.raises(ValueError, match="not a multiple"):
        grouped_attention_forward(None, query[:, :3], key, value, keep)


def test_engine_decodes_with_grouped_attention_and_restores_the_models_own(tmp_path, monkeypatch):
    calls = []
    original = grouped_attention.grouped_attention_forward
    monkeypatch.setattr(grouped_attention, "grouped_attention_forward",
                        lambda *args, **kwargs: calls.append(args[1].shape[2]) or original(*args, **kwargs))
    engine = HFEngine(save_tiny_qwen2(tmp_path / "m"), decode="static_eager")
    engine.generate(PROMPTS, 2, 5, 1.0, 1.0, 0, EOS, PAD)
    assert engine._sampler.decoder.decode_attention == grouped_attention.NAME
    assert calls and set(calls) == {1}  # decode steps (q = 1) only: prefill keeps the model's own
    assert engine.model.config._attn_implementation == "sdpa"


def test_a_model_with_sinks_keeps_its_own_attention(tmp_path):
    model = HFEngine(save_tiny_qwen2(tmp_path / "m")).model
    model.model.layers[0].self_attn.sinks = torch.nn.Parameter(torch.zeros(4))
    assert grouped_attention.refusal(model) == "attention sinks"
    decoder = static_decode.StaticDecoder(model, 2, 128, use_graphs=False, prefill_tokens=8)
    assert decoder.decode_attention is None
