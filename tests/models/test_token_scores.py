"""The chunked logprob path (`policy.score`, `reference_score`, models/token_scores.py) against the
full-logit path it replaces: same logprobs, entropies, values and gradients in float32, with LoRA on a
tied embedding and with full fine-tuning; gradient checkpointing changes no gradient. And the full-logit
helpers themselves (`logprobs_from_logits`, `entropy_from_logits`) against hand-worked values."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import MistralConfig, MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM

from prmppo.models.policy import FullPolicy, LoraPolicy
from prmppo.models.token_scores import entropy_from_logits, logprobs_from_logits, token_scores
from prmppo.ppo import maths
from prmppo.ppo.batch import collate

TEMPERATURE = 0.7


def _model(tied: bool, arch: str = "mistral"):
    torch.manual_seed(0)
    shape = dict(vocab_size=40, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=tied)
    return MistralForCausalLM(MistralConfig(**shape)) if arch == "mistral" else Qwen2ForCausalLM(Qwen2Config(**shape))


def _policy(kind: str, tied: bool = True, arch: str = "mistral"):
    if kind == "full":
        policy = FullPolicy(_model(tied, arch), detach_value_hidden=False, critic=True)
        with torch.no_grad():  # move the trained weights away from the frozen reference
            for p in policy.model.parameters():
                p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())) * 0.05)
        return policy
    policy = LoraPolicy(_model(tied, arch), detach_value_hidden=False, critic=True, r=4, alpha=8,
                        target_modules=["q_proj", "v_proj", "down_proj"])
    with torch.no_grad():  # B starts at zero: move it so the adapter changes the logits
        for name, p in policy.model.named_parameters():
            if "lora_B" in name:
                p.normal_(std=0.2, generator=torch.Generator().manual_seed(len(name)))
    return policy


def _rows():
    """6 rows with prompts of 1-5 tokens and responses of 1-7 (the layout the loop trains on)."""
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(4, 40, (int(n),), generator=g).tolist() for n in torch.randint(1, 6, (6,), generator=g)]
    responses = [torch.randint(4, 40, (int(n),), generator=g).tolist() for n in torch.randint(1, 8, (6,), generator=g)]
    return collate(prompts, responses, pad_token_id=0)


def _full_logit_scores(logits, response_ids, plen):
    """The path being replaced: the [B, T, V] logits, upcast, tempered, log-softmaxed whole."""
    scaled = logits[:, plen - 1:plen - 1 + response_ids.shape[1]].float() / TEMPERATURE  # [B, T, V]
    return logprobs_from_logits(scaled, response_ids), entropy_from_logits(scaled)


@pytest.mark.parametrize("kind, tied, arch", [("lora", True, "mistral"), ("lora", False, "qwen2"),
                                              ("full", True, "qwen2"), ("full", False, "mistral")])
@pytest.mark.parametrize("chunk_tokens", [1, 5, 4096])
def test_score_equals_the_full_logit_path(kind, tied, arch, chunk_tokens):
    policy = _policy(kind, tied, arch)
    policy.train(False)
    ids, att, pos, resp, mask, plen = _rows()
    with torch.no_grad():
        logits, values = policy.forward(ids, att, pos)
        logprobs, entropy = _full_logit_scores(logits, resp, plen)
        ref_logprobs, _ = _full_logit_scores(policy.reference_logits(ids, att, pos), resp, plen)
        scored = policy.score(ids, att, pos, resp, mask, plen, TEMPERATURE, chunk_tokens, with_entropy=True)
        ref = policy.reference_score(ids, att, pos, resp, mask, plen, TEMPERATURE, chunk_tokens)
    on = mask.bool()
    assert (logprobs - ref_logprobs)[on].abs().max() > 1e-3  # the adapter/weights do move the policy
    torch.testing.assert_close(scored.logprobs[on], logprobs[on], rtol=0, atol=1e-5)
    torch.testing.assert_close(scored.entropy[on], entropy[on], rtol=0, atol=1e-5)
    torch.testing.assert_close(ref[on], ref_logprobs[on], rtol=0, atol=1e-5)
    torch.testing.assert_close(scored.values, values, rtol=0, atol=1e-6)
    assert not scored.logprobs[~on].any() and not ref[~on].any()  # nothing computed on padding


def _grads(policy, use_score: bool, weights):
    """Gradients of sum(w1 * logprob + w2 * entropy + w3 * value) over response tokens."""
    ids, att, pos, resp, mask, plen = _rows()
    policy.train(False)
    if use_score:
        scored = policy.score(ids, att, pos, resp, mask, plen, TEMPERATURE, 4, with_entropy=True)
        logprobs, entropy, values = scored.logprobs, scored.entropy, scored.values
    else:
        logits, values = policy.forward(ids, att, pos)
        logprobs, entropy = _full_logit_scores(logits, resp, plen)
    values = values[:, plen - 1:plen - 1 + resp.shape[1]]
    loss = sum(maths.masked_sum(w * x, mask) for w, x in zip(weights, (logprobs, entropy, values)))
    loss.backward()
    params = policy.policy_parameters() + policy.value_parameters()
    grads = [p.grad.clone() for p in params]
    for p in params:
        p.grad = None
    return grads


@pytest.mark.parametrize("kind, tied", [("lora", True), ("full", True), ("full", False)])
def test_gradients_equal_the_full_logit_path(kind, tied):
    policy = _policy(kind, tied)
    g = torch.Generator().manual_seed(2)
    weights = [torch.randn(6, 7, generator=g) for _ in range(3)]  # [B, T] each
    expected, got = _grads(policy, False, weights), _grads(policy, True, weights)
    assert len(expected) == len(got) > 0
    for e, x in zip(expected, got):
        assert e.abs().max() > 0
        torch.testing.assert_close(x, e, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("kind", ["lora", "full"])
def test_gradient_checkpointing_recomputes_layers_and_keeps_gradients(kind):
    weights = [torch.randn(6, 7, generator=torch.Generator().manual_seed(3)) for _ in range(3)]
    plain = _policy(kind)
    expected = _grads(plain, True, weights)
    policy = _policy(kind)
    policy.enable_gradient_checkpointing()
    calls = []
    layer = policy.model.get_decoder().layers[0] if kind == "full" else \
        policy.model.get_base_model().get_decoder().layers[0]
    layer.self_attn.register_forward_pre_hook(lambda *args: calls.append(1))
    got = _grads(policy, True, weights)
    assert len(calls) == 2  # the forward, and its recompute in backward
    for e, x in zip(expected, got):
        torch.testing.assert_close(x, e, rtol=1e-5, atol=1e-7)


def test_token_scores_refuses_mismatched_shapes_and_a_zero_chunk():
    head = torch.nn.Linear(4, 10)
    with pytest.raises(ValueError, match="must agree"):
        token_scores(head, torch.zeros(2, 3, 4), torch.zeros(2, 4, dtype=torch.long), torch.ones(2, 4), 1.0, 8)
    with pytest.raises(ValueError, match="ppo.logit_chunk_tokens"):
        token_scores(head, torch.zeros(2, 3, 4), torch.zeros(2, 3, dtype=torch.long), torch.ones(2, 3), 1.0, 0)


def test_score_refuses_a_model_that_scales_its_logits():
    policy = _policy("full")
    policy.model.config.final_logit_softcapping = 30.0
    ids, att, pos, resp, mask, plen = _rows()
    with pytest.raises(ValueError, match="final_logit_softcapping"):
        policy.score(ids, att, pos, resp, mask, plen, TEMPERATURE, 8)


def test_a_logged_only_entropy_has_no_graph_and_the_same_values():
    policy = _policy("lora")
    policy.train(False)
    ids, att, pos, resp, mask, plen = _rows()
    with_grad = policy.score(ids, att, pos, resp, mask, plen, TEMPERATURE, 4, with_entropy=True)
    logged = policy.score(ids, att, pos, resp, mask, plen, TEMPERATURE, 4, with_entropy=True, entropy_grad=False)
    assert with_grad.entropy.requires_grad and not logged.entropy.requires_grad
    assert logged.logprobs.requires_grad
    torch.testing.assert_close(logged.entropy, with_grad.entropy.detach(), rtol=0, atol=0)


# ------------------------------------------------------------ logprobs and entropies from full logits

def t(rows):
    return torch.tensor(rows, dtype=torch.float64)


def close(actual, expected, atol=1e-6):
    torch.testing.assert_close(torch.as_tensor(actual, dtype=torch.float64),
                               torch.as_tensor(expected, dtype=torch.float64),
                               atol=atol, rtol=0)


def test_entropy_of_uniform_logits_is_log_vocab():
    close(entropy_from_logits(torch.zeros(2, 3, 7, dtype=torch.float64)),
          torch.full((2, 3), math.log(7)))


def test_entropy_with_masked_vocab_and_against_definition():
    logits = t([[[0.0, 0.0, 0.0, float("-inf")]]]).requires_grad_()
    entropy = entropy_from_logits(logits)
    close(entropy, [[math.log(3)]])  # uniform over the 3 finite entries
    entropy.sum().backward()
    assert torch.isfinite(logits.grad).all()
    torch.manual_seed(2)
    raw = torch.randn(2, 3, 5, dtype=torch.float64) * 4 + 1000  # large offset: must be stable
    p = torch.softmax(raw, -1)
    close(entropy_from_logits(raw), -(p * torch.log(p)).sum(-1), atol=1e-9)


def test_logprobs_from_logits_matches_log_softmax_gather():
    torch.manual_seed(3)
    logits = torch.randn(2, 4, 6, dtype=torch.float64) + 500.0
    tokens = torch.randint(0, 6, (2, 4))
    expected = torch.empty(2, 4, dtype=torch.float64)
    for b in range(2):
        for i in range(4):
            expected[b, i] = torch.log_softmax(logits[b, i], -1)[tokens[b, i]]
    close(logprobs_from_logits(logits, tokens), expected, atol=1e-9)
    # 2 logits [0, ln 3]: p(token 1) = 3 / 4
    close(logprobs_from_logits(t([[[0.0, math.log(3)]]]), torch.tensor([[1]])), [[math.log(0.75)]])
    with pytest.raises(ValueError, match="tokens shape"):
        logprobs_from_logits(logits, tokens[:, :3])


def test_logprobs_from_logits_upcasts_bf16():
    out = logprobs_from_logits(torch.zeros(1, 2, 4, dtype=torch.bfloat16), torch.tensor([[0, 3]]))
    assert out.dtype == torch.float32
    close(out, [[math.log(0.25)] * 2])
