"""LoRA policy on a resident base: starts equal to the reference, merged save equals the live policy;
the reference stays the base after a PRM adapter loads (LoRA and full fine-tuning)."""

from __future__ import annotations

import pytest
import torch
from transformers import MistralConfig, MistralForCausalLM

from prmppo.models.loading import load_model
from prmppo.models.policy import FullPolicy, LoraPolicy
from conftest import GraphCounter, save_perturbed_prm
from prmppo.models.prm import PRM_ADAPTER, adapter_active, load_prm, make_head
from prmppo.models.tiny import build_char_tokenizer

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _model(seed=0):
    torch.manual_seed(seed)
    cfg = MistralConfig(vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                        tie_word_embeddings=True)
    return MistralForCausalLM(cfg).eval()


def _inputs():
    ids = torch.randint(4, 24, (3, 10), generator=torch.Generator().manual_seed(1))
    att = torch.ones_like(ids)
    return ids, att, att.cumsum(-1) - 1


def test_lora_policy_starts_at_the_reference_and_moves_away():
    policy = LoraPolicy(_model(), detach_value_hidden=True, critic=True, r=4, alpha=8, target_modules=TARGETS)
    ids, att, pos = _inputs()
    logits, values = policy.forward(ids, att, pos)
    assert torch.allclose(logits, policy.reference_logits(ids, att, pos), atol=1e-6)
    assert torch.count_nonzero(values) == 0  # zero-initialised value head
    with torch.no_grad():
        for p in policy.policy_parameters():
            p.add_(0.05 * torch.randn_like(p))
    moved, _ = policy.forward(ids, att, pos)
    assert (moved - policy.reference_logits(ids, att, pos)).abs().max() > 1e-3
    trainable = {n for n, p in policy.model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)


def test_lora_init_is_seeded():
    a = LoraPolicy(_model(), True, True, r=4, target_modules=TARGETS, init_seed=3).policy_parameters()
    b = LoraPolicy(_model(), True, True, r=4, target_modules=TARGETS, init_seed=3).policy_parameters()
    c = LoraPolicy(_model(), True, True, r=4, target_modules=TARGETS, init_seed=4).policy_parameters()
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert not all(torch.equal(x, y) for x, y in zip(a, c))


def test_merged_checkpoint_reproduces_the_live_policy(tmp_path):
    policy = LoraPolicy(_model(), detach_value_hidden=True, critic=True, r=4, alpha=8, target_modules=TARGETS)
    with torch.no_grad():
        for p in policy.policy_parameters():
            p.add_(0.05 * torch.randn_like(p))
    policy.save_merged(tmp_path / "merged", build_char_tokenizer("0123456789+-=\nAnswer: "))
    ids, att, pos = _inputs()
    live, _ = policy.forward(ids, att, pos)
    reloaded = load_model(tmp_path / "merged")(input_ids=ids, attention_mask=att, position_ids=pos).logits
    assert torch.allclose(live, reloaded, atol=1e-5)
    # the base itself was not modified by the merge: the reference is unchanged
    assert torch.allclose(policy.reference_logits(ids, att, pos), _model()(ids).logits, atol=1e-5)


def test_value_head_detach_controls_backbone_gradients():
    ids, att, pos = _inputs()
    for detach, expect_grad in ((True, False), (False, True)):
        policy = LoraPolicy(_model(), detach_value_hidden=detach, critic=True, r=4, target_modules=TARGETS)
        torch.nn.init.normal_(policy.value_head.linear.weight)
        _, values = policy.forward(ids, att, pos)
        values.sum().backward()
        got = any(p.grad is not None and p.grad.abs().sum() > 0 for p in policy.policy_parameters())
        assert got == expect_grad


def test_full_policy_keeps_a_frozen_reference():
    policy = FullPolicy(_model(), detach_value_hidden=True, critic=True)
    with pytest.raises(ValueError, match="lora=adapter"):
        policy.save_adapter(None)
    ids, att, pos = _inputs()
    with torch.no_grad():
        for p in policy.policy_parameters():
            p.add_(0.01)
    logits, _ = policy.forward(ids, att, pos)
    assert (logits - policy.reference_logits(ids, att, pos)).abs().max() > 1e-4


def test_modules_to_save_trains_the_final_norm_at_its_own_lr_and_every_sync_carries_it(tmp_path):
    from peft import PeftModel

    policy = LoraPolicy(_model(), detach_value_hidden=True, critic=True, r=4, alpha=8, target_modules=TARGETS,
                        modules_to_save=["model.norm"], modules_to_save_lr=0.5)
    groups = policy.policy_param_groups(1e-4)
    assert [g["lr"] for g in groups] == [1e-4, 0.5]
    assert len(groups[1]["params"]) == 1 and groups[1]["params"][0].shape == (32,)  # the norm's weight
    assert sum(len(g["params"]) for g in groups) == len(policy.policy_parameters())
    ids, att, pos = _inputs()
    reference = policy.reference_logits(ids, att, pos)
    with torch.no_grad():
        groups[1]["params"][0].mul_(2.0)  # doubles every logit: the lm_head has no bias
    live, _ = policy.forward(ids, att, pos)
    assert torch.allclose(live, 2 * reference, atol=1e-4)
    # the reference (adapters off) still uses the base's own norm
    assert torch.allclose(policy.reference_logits(ids, att, pos), _model()(ids).logits, atol=1e-5)
    # checkpoint sync: the merged directory holds the trained norm under the base's key
    policy.save_merged(tmp_path / "merged", build_char_tokenizer("0123456789+-=\nAnswer: "))
    merged = load_model(tmp_path / "merged")(input_ids=ids, attention_mask=att, position_ids=pos).logits
    assert torch.allclose(live, merged, atol=1e-4)
    # adapter sync: the saved adapter carries the norm beside the LoRA factors
    policy.save_adapter(tmp_path / "adapter")
    served = PeftModel.from_pretrained(_model(), str(tmp_path / "adapter" / "policy"), adapter_name="sync1")
    assert torch.allclose(live, served(input_ids=ids, attention_mask=att, position_ids=pos).logits, atol=1e-4)


def test_modules_to_save_refuses_unknown_and_tied_modules():
    with pytest.raises(ValueError, match="no module of the base model is named 'final_norm'"):
        LoraPolicy(_model(), True, True, r=4, target_modules=TARGETS, modules_to_save=["final_norm"])
    with pytest.raises(ValueError, match="tied input/output embedding"):
        LoraPolicy(_model(), True, True, r=4, target_modules=TARGETS, modules_to_save=["lm_head"])


def _saved_prm(prm_dir) -> torch.Tensor:
    """Save a PRM with non-trivial (perturbed) adapter weights on `_model()` to `prm_dir`; returns its
    LM logits [3, 10, 32] on `_inputs()` with the `prm` adapter on."""
    peft_model = save_perturbed_prm(_model(), prm_dir, make_head("classifier", 32, None), TARGETS)
    ids, att, pos = _inputs()
    with torch.no_grad():
        return peft_model(input_ids=ids, attention_mask=att, position_ids=pos).logits


@pytest.mark.parametrize("policy_type", [LoraPolicy, FullPolicy])
def test_reference_stays_the_base_after_a_prm_loads_on_the_prm_host(tmp_path, policy_type):
    prm_logits = _saved_prm(tmp_path / "prm")
    ids, att, pos = _inputs()
    with torch.no_grad():
        base = _model()(input_ids=ids, attention_mask=att, position_ids=pos).logits  # [3, 10, 32]
    # the PRM adapter moves the LM's logits, so a reference that carried it would show here
    assert (prm_logits - base).abs().max() > 0.1
    if policy_type is LoraPolicy:
        policy = LoraPolicy(_model(), detach_value_hidden=True, critic=True, r=4, alpha=8, target_modules=TARGETS)
    else:
        policy = FullPolicy(_model(), detach_value_hidden=True, critic=True)
    with torch.no_grad():  # the policy moves away from the base; the reference must not follow
        for p in policy.policy_parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(2)))
    trainable_before = {n: p.requires_grad for n, p in policy.model.named_parameters()}
    # the same call as the ppo stage's `_reward`: the PRM joins the policy's prm_host
    peft_model, _ = load_prm(tmp_path / "prm", policy.prm_host, None)

    assert torch.allclose(policy.reference_logits(ids, att, pos), base, atol=1e-6)
    with adapter_active(peft_model, PRM_ADAPTER):  # how LearnedStepScorer runs the PRM: unchanged by the fix
        with torch.no_grad():
            scored = peft_model(input_ids=ids, attention_mask=att, position_ids=pos).logits
    assert torch.allclose(scored, prm_logits, atol=1e-5)
    # a reference pass after a scoring pass still switches the PRM off, and leaves it frozen
    assert torch.allclose(policy.reference_logits(ids, att, pos), base, atol=1e-6)
    prm_flags = [p.requires_grad for n, p in peft_model.named_parameters() if f".{PRM_ADAPTER}." in n]
    assert prm_flags and not any(prm_flags)
    after = {n: p.requires_grad for n, p in policy.model.named_parameters()}
    assert {n: after[n] for n in trainable_before} == trainable_before


def _twin_policies(critic: bool) -> tuple[LoraPolicy, LoraPolicy]:
    """Two LoRA policies on the same model with the same moved adapter: one to compile, one to run eagerly."""
    eager = LoraPolicy(_model(), detach_value_hidden=True, critic=critic, r=4, alpha=8, target_modules=TARGETS)
    policy = LoraPolicy(_model(), detach_value_hidden=True, critic=critic, r=4, alpha=8, target_modules=TARGETS)
    with torch.no_grad():
        for p, q in zip(policy.policy_parameters(), eager.policy_parameters()):
            p.add_(0.05 * torch.randn_like(p))
            q.copy_(p)
    return eager, policy


def test_compiled_layers_run_one_graph_for_micro_batches_with_and_without_padding(monkeypatch):
    """A micro-batch whose rows all have the same length has no padding. transformers then hands the decoder
    layers no mask at all, where a padded micro-batch gets a boolean one: for compiled layers (`ppo.compile`)
    that is another graph, compiled mid-run when the first such micro-batch comes. The policy builds the
    mask itself for compiled layers, so the graph a padded micro-batch compiled serves both, and the scores
    match the uncompiled model's. A counting backend records each graph dynamo hands it."""
    torch._dynamo.reset()
    eager, policy = _twin_policies(critic=True)
    counting = GraphCounter()
    graphs = counting.graphs
    compile_module = torch.nn.Module.compile
    monkeypatch.setattr(torch.nn.Module, "compile",
                        lambda module, **kwargs: compile_module(module, **{**kwargs, "backend": counting}))
    policy.compile_decoder_layers()
    generator = torch.Generator().manual_seed(3)
    seen = []
    for rows, width, pad in ((3, 12, 4), (4, 9, 0), (2, 14, 0), (3, 11, 2)):
        ids = torch.randint(4, 24, (rows, width), generator=generator)
        att = torch.ones_like(ids)
        att[0, :pad] = 0  # left padding on the first row
        pos = (att.cumsum(-1) - 1).clamp(min=0)
        prompt = 5
        response_ids, response_mask = ids[:, prompt:], torch.ones_like(ids[:, prompt:])
        with torch.enable_grad():
            got = policy.score(ids, att, pos, response_ids, response_mask, prompt, 1.0, 64)
        want = eager.score(ids, att, pos, response_ids, response_mask, prompt, 1.0, 64)
        assert torch.allclose(got.logprobs, want.logprobs, atol=1e-5), (rows, width, pad)
        ref = policy.reference_score(ids, att, pos, response_ids, response_mask, prompt, 1.0, 64)
        assert torch.allclose(ref, eager.reference_score(ids, att, pos, response_ids, response_mask, prompt, 1.0, 64),
                              atol=1e-5), (rows, width, pad)
        seen.append(len(graphs))
    # the first micro-batch compiles the score's graph (grad mode) and the reference's (no grad, adapter off);
    # the later ones, padded or not, of other rows and widths, compile nothing
    assert seen == [2] * 4, seen
    torch._dynamo.reset()


def test_checkpointed_compiled_layers_run_one_graph_per_no_grad_pass():
    """Gradient checkpointing makes the embeddings' output require grad (a grad path into the first layer
    under LoRA's frozen embeddings). Done under no_grad too, the first compiled layer would see an input
    unlike the later layers' and compile a graph of its own in every no-grad pass (the reference, the PRM's
    scoring). In grad mode the first layer's input must still require grad, as the later layers' do."""
    torch._dynamo.reset()
    policy = LoraPolicy(_model(), detach_value_hidden=True, critic=True, r=4, alpha=8, target_modules=TARGETS)
    policy.enable_gradient_checkpointing()
    layers = policy.model.get_base_model().model.layers
    counting, inputs_grad = GraphCounter(), []
    graphs = counting.graphs
    layers[0].register_forward_pre_hook(lambda module, args: inputs_grad.append(args[0].requires_grad))
    for layer in layers:
        layer.compile(backend=counting, dynamic=True)
    ids, att, pos = _inputs()
    response_ids, response_mask = ids[:, 4:], torch.ones_like(ids[:, 4:])
    policy.reference_score(ids, att, pos, response_ids, response_mask, 4, 1.0, 64)
    assert len(graphs) == 1, "one graph serves every layer in a no-grad pass"
    assert inputs_grad == [False]
    with torch.enable_grad():
        scored = policy.score(ids, att, pos, response_ids, response_mask, 4, 1.0, 64)
    assert len(graphs) == 2 and inputs_grad == [False, True]
    scored.logprobs.sum().backward()
    assert all(p.grad is not None for p in policy.policy_parameters())
    torch._dynamo.reset()


def test_compiled_checkpointed_layers_checkpoint_outside_their_graphs_and_match_eager_gradients(monkeypatch):
    """With `ppo.compile` and `ppo.gradient_checkpointing`, the checkpoint wraps each layer's compiled forward
    from outside: no graph dynamo compiles holds a checkpoint (inside one, the partitioner wraps the attention
    kernel in an RNG-replaying operator that torch 2.11 keeps out of its FX graph cache, so every run
    compiled the update's graph cold). Each layer still recomputes its forward in backward, and the gradients
    are the uncompiled, uncheckpointed policy's."""
    torch._dynamo.reset()
    eager, policy = _twin_policies(critic=False)
    runs = []  # one entry per run of a compiled graph

    class CountingRuns(GraphCounter):
        def __call__(self, gm, example_inputs):
            super().__call__(gm, example_inputs)
            return lambda *args: runs.append(gm) or gm.forward(*args)

    counting = CountingRuns()
    compile_fn = torch.compile
    monkeypatch.setattr(torch, "compile", lambda fn, **kwargs: compile_fn(fn, **{**kwargs, "backend": counting}))
    policy.enable_gradient_checkpointing()
    policy.compile_decoder_layers()
    policy.train()
    eager.train()
    layers = policy.model.get_base_model().model.layers
    ids, att, pos = _inputs()
    response_ids, response_mask = ids[:, 4:], torch.ones_like(ids[:, 4:])
    with torch.enable_grad():
        got = policy.score(ids, att, pos, response_ids, response_mask, 4, 1.0, 64)
        want = eager.score(ids, att, pos, response_ids, response_mask, 4, 1.0, 64)
    assert len(runs) == len(layers)  # each layer's forward
    got.logprobs.sum().backward()
    assert len(runs) == 2 * len(layers)  # then its recompute in backward
    want.logprobs.sum().backward()
    assert torch.allclose(got.logprobs, want.logprobs, atol=1e-5)
    for (name, p), q in zip(policy.model.named_parameters(), eager.model.parameters()):
        if p.requires_grad:
            assert torch.allclose(p.grad, q.grad, atol=1e-5), name
    assert counting.graphs, "nothing was compiled"
    hops = [str(node.target) for gm in counting.graphs for node in gm.graph.nodes if "checkpoint" in str(node.target)]
    assert hops == [], f"a checkpoint inside a compiled graph: {hops}"
    torch._dynamo.reset()


def test_compiling_the_layers_traces_each_graph_once(monkeypatch):
    """The layers' float constants (norm epsilon, LoRA scaling, attention scale) are specialised: traced as
    symbolic floats, they make dynamo restart its analysis of every graph once (AOT's pass fails to turn them
    into tensors), which on a GPU costs seconds per graph at every start, warm compile cache or not."""
    torch._dynamo.reset()
    restarts = []
    original_init = torch._dynamo.exc.TensorifyScalarRestartAnalysis.__init__

    def counted(self, *args, **kwargs):
        restarts.append(args)
        original_init(self, *args, **kwargs)

    monkeypatch.setattr(torch._dynamo.exc.TensorifyScalarRestartAnalysis, "__init__", counted)
    compile_fn = torch.compile
    monkeypatch.setattr(torch, "compile", lambda fn, **kwargs: compile_fn(fn, **{**kwargs, "backend": "aot_eager"}))
    policy = LoraPolicy(_model(), detach_value_hidden=True, critic=False, r=4, alpha=8, target_modules=TARGETS)
    with torch._dynamo.config.patch(specialize_float=False):  # the default, whatever ran before; put back after
        policy.compile_decoder_layers()
        ids, att, pos = _inputs()
        response_ids, response_mask = ids[:, 4:], torch.ones_like(ids[:, 4:])
        with torch.enable_grad():
            policy.score(ids, att, pos, response_ids, response_mask, 4, 1.0, 64).logprobs.sum().backward()
        policy.reference_score(ids, att, pos, response_ids, response_mask, 4, 1.0, 64)
    assert restarts == []
    torch._dynamo.reset()


def test_the_reference_passes_switch_the_adapters_off_without_peft_status_reports(monkeypatch):
    # peft's disable_adapter builds get_model_status (every adapter layer's repr) at each entry: host time the
    # no-grad pass pays once per micro-batch. The reference must still be the base, with the adapter trainable after.
    from peft import PeftModel

    policy = LoraPolicy(_model(), detach_value_hidden=True, critic=False, r=4, alpha=8, target_modules=TARGETS)
    with torch.no_grad():
        for p in policy.policy_parameters():
            p.add_(0.05 * torch.randn_like(p))
    ids, att, pos = _inputs()
    base = _model()(input_ids=ids, attention_mask=att, position_ids=pos).logits
    reports = []
    real = PeftModel.get_model_status
    monkeypatch.setattr(PeftModel, "get_model_status", lambda self: reports.append(1) or real(self))
    assert torch.allclose(policy.reference_logits(ids, att, pos), base, atol=1e-5)
    response = ids[:, 6:]
    ref = policy.reference_score(ids, att, pos, response, torch.ones_like(response).float(), 6, 1.0, 64)
    expected = torch.log_softmax(base[:, 5:9].float(), -1).gather(-1, response[..., None]).squeeze(-1)
    assert torch.allclose(ref, expected, atol=1e-5)
    assert reports == []
    assert all(p.requires_grad for p in policy.policy_parameters())
    assert (policy.forward(ids, att, pos)[0] - base).abs().max() > 1e-3  # the adapter is on again
