"""`ppo.fused_lora`: each peft LoRA linear as one matmul (models/lora_matmul.py): the same function and
gradients as peft's base + branch, peft's own forward wherever the fused one does not apply."""

from __future__ import annotations

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from prmppo.models.lora_matmul import LoraMatmul, fuse_lora_linears, is_fused
from prmppo.models.policy import LoraPolicy


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no_bias"])
@pytest.mark.parametrize("weight_grad", [False, True], ids=["frozen_weight", "trained_weight"])
def test_lora_matmul_gradients_are_the_functions(bias, weight_grad):
    """gradcheck in float64: forward and every gradient (x, A, B; W and bias when they require one)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 5, dtype=torch.float64, generator=g, requires_grad=True)
    weight = torch.randn(7, 5, dtype=torch.float64, generator=g, requires_grad=weight_grad)
    b = torch.randn(7, dtype=torch.float64, generator=g, requires_grad=weight_grad) if bias else None
    lora_a = torch.randn(2, 5, dtype=torch.float64, generator=g, requires_grad=True)
    lora_b = torch.randn(7, 2, dtype=torch.float64, generator=g, requires_grad=True)
    expected = x @ weight.T + (x @ lora_a.T @ lora_b.T) * 0.75 + (0 if b is None else b)
    torch.testing.assert_close(LoraMatmul.apply(x, weight, b, lora_a, lora_b, 0.75), expected)
    assert torch.autograd.gradcheck(lambda *t: LoraMatmul.apply(*t, 0.75), (x, weight, b, lora_a, lora_b))


def _policy(seed: int = 0, dtype=torch.float32) -> LoraPolicy:
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(Qwen2Config(vocab_size=48, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                         tie_word_embeddings=True)).to(dtype)
    policy = LoraPolicy(model, detach_value_hidden=True, critic=False, r=4, alpha=8, dropout=0.0,
                        target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    with torch.no_grad():  # LoRA B away from its zero init, so the branch counts
        for name, p in policy.model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(1)).to(dtype) * 0.1)
    return policy


def _branch_calls(policy) -> list[int]:
    """A counter of the calls of every LoRA B module (peft's branch runs them; the fused forward does not)."""
    calls = [0]
    for name, module in policy.model.named_modules():
        if name.endswith("lora_B.policy"):
            module.register_forward_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    return calls


def _score(policy, ids):
    att, pos = torch.ones_like(ids), torch.arange(ids.shape[1]).expand_as(ids)
    return policy.score(ids, att, pos, ids[:, 3:], torch.ones_like(ids[:, 3:]), 3, 1.0, 4).logprobs


def test_fused_linears_give_peft_numbers_and_gradients_without_running_the_branch():
    ids = torch.randint(0, 48, (3, 9), generator=torch.Generator().manual_seed(2))
    peft_policy, fused_policy = _policy(), _policy()
    assert fuse_lora_linears(fused_policy.model) == 14  # 7 linears x 2 layers
    peft_calls, fused_calls = _branch_calls(peft_policy), _branch_calls(fused_policy)
    grads = []
    for policy in (peft_policy, fused_policy):
        logprobs = _score(policy, ids)
        logprobs.sum().backward()
        grads.append((logprobs.detach(), {n: p.grad for n, p in policy.model.named_parameters() if p.grad is not None}))
    (lp_peft, g_peft), (lp_fused, g_fused) = grads
    torch.testing.assert_close(lp_fused, lp_peft, rtol=1e-5, atol=1e-5)
    assert g_fused.keys() == g_peft.keys() and any("lora_A" in n for n in g_fused)
    for name in g_peft:
        torch.testing.assert_close(g_fused[name], g_peft[name], rtol=1e-4, atol=1e-6, msg=name)
    assert peft_calls[0] == 14 and fused_calls[0] == 0


def test_calls_the_fused_forward_does_not_cover_run_pefts_own():
    ids = torch.randint(0, 48, (2, 7), generator=torch.Generator().manual_seed(3))
    peft_policy, fused_policy = _policy(), _policy()
    fuse_lora_linears(fused_policy.model)
    assert all(is_fused(m) for n, m in fused_policy.model.named_modules() if n.endswith("q_proj"))
    calls = _branch_calls(fused_policy)
    with torch.no_grad():
        # the reference: adapters off, the base's own numbers to the bit
        ref = [p.reference_score(ids, torch.ones_like(ids), torch.arange(7).expand_as(ids), ids[:, 3:],
                                 torch.ones_like(ids[:, 3:]), 3, 1.0, 4) for p in (peft_policy, fused_policy)]
        assert torch.equal(ref[0], ref[1]) and calls[0] == 0
        with torch.autocast("cpu", dtype=torch.bfloat16):  # autocast: peft's branch, the same numbers
            auto = [_score(p, ids) for p in (peft_policy, fused_policy)]
        assert torch.equal(auto[0], auto[1]) and calls[0] == 14
        fused_policy.model.train()  # dropout of p > 0 in training mode would be skipped by one matmul
        for module in fused_policy.model.modules():
            if hasattr(module, "lora_dropout"):
                module.lora_dropout["policy"] = torch.nn.Dropout(0.5)
        _score(fused_policy, ids)
        assert calls[0] == 28


def test_fused_lora_needs_a_lora_policy():
    from conftest import compose_config
    from prmppo.errors import ConfigError
    from prmppo.validate import validate_config

    with pytest.raises(ConfigError, match="ppo.fused_lora=true fuses LoRA linears, but lora=none"):
        validate_config(compose_config(["debug=smoke", "lora=none", "ppo.fused_lora=true"]))
    validate_config(compose_config(["debug=smoke", "ppo.fused_lora=true"]))  # lora=adapter: nothing to say


def _compiled_run(fused: bool, ids):
    """Logprobs and gradients of a compiled, checkpointed policy (fused or not) and dynamo's graph breaks."""
    import torch._dynamo

    policy = _policy()
    if fused:
        fuse_lora_linears(policy.model)
    policy.enable_gradient_checkpointing()
    policy.compile_decoder_layers()
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    policy.train(False)
    logprobs = _score(policy, ids)
    logprobs.sum().backward()
    grads = {n: p.grad for n, p in policy.model.named_parameters() if p.grad is not None}
    return logprobs.detach(), grads, sorted(torch._dynamo.utils.counters["graph_break"])


@pytest.mark.slow
def test_fused_lora_runs_inside_the_compiled_layers_graph():
    """Compiled, checkpointed layers (the GPU recipe): the fused forward adds no graph break to those of peft's
    (the checkpoint's own, outside the graph, by design), and gives the eager fused forward's numbers."""
    ids = torch.randint(0, 48, (3, 16), generator=torch.Generator().manual_seed(5))
    eager = _policy()
    fuse_lora_linears(eager.model)
    eager.enable_gradient_checkpointing()
    eager.train(False)
    expected = _score(eager, ids)
    expected.sum().backward()
    logprobs, grads, breaks = _compiled_run(True, ids)
    assert breaks == _compiled_run(False, ids)[2]
    torch.testing.assert_close(logprobs, expected.detach(), rtol=1e-5, atol=1e-5)
    for name, p in eager.model.named_parameters():
        if p.grad is not None:
            torch.testing.assert_close(grads[name], p.grad, rtol=1e-4, atol=1e-6, msg=name)
