"""The in-process engine (`rollout=inprocess`) on tiny Mistral policies built from config.

It must sample exactly what the worker's engine (`HFEngine`, which the worker process runs) samples
for the same weights and seed, under LoRA (the worker merges the synced adapter into its own base;
the in-process engine runs the trainer's peft model with the adapter on) and under full fine-tuning;
and it must do so on the trainer's own tensors: no merged copy, no second base.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import MistralConfig, MistralForCausalLM

from conftest import compose_config
from prmppo.config.build import build
from prmppo.models.policy import FullPolicy, LoraPolicy
from prmppo.rollout.hf_engine import HFEngine
from prmppo.rollout.protocol import RolloutRequest, RolloutWorkerError, WeightsSpec

EOS, PAD = 2, 0
PROMPTS = [[5, 6, 7], [8, 9, 10, 11, 12, 13, 14], [3]]  # different lengths: left padding matters
N_SAMPLES, MAX_NEW_TOKENS = 2, 8


def tiny_model(seed: int = 0) -> MistralForCausalLM:
    """Shapes chosen so that no activation of a request has the shape of a weight matrix: vocab 40,
    hidden 32, MLP 48 (the no-copy test looks for new tensors shaped like the weights)."""
    torch.manual_seed(seed)
    return MistralForCausalLM(MistralConfig(
        vocab_size=40, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=False))


def lora_policy(base_dir, dropout: float = 0.0) -> LoraPolicy:
    """A LoRA policy on the model saved at `base_dir`, with a nonzero adapter and a trained final norm."""
    model = MistralForCausalLM.from_pretrained(base_dir)
    policy = LoraPolicy(model, detach_value_hidden=True, critic=False, r=4, alpha=8, dropout=dropout,
                        target_modules=["q_proj", "v_proj", "down_proj"], modules_to_save=["model.norm"])
    generator = torch.Generator().manual_seed(4)
    with torch.no_grad():
        for name, parameter in policy.model.named_parameters():
            if "lora_B" in name or ".modules_to_save.policy." in name:
                parameter.add_(torch.randn(parameter.shape, generator=generator) * 0.5)
    return policy


def in_process_engine(model: nn.Module, decode: str = "static", merge: bool = False, compile_decode: bool = False):
    """The engine as a run builds it: from the real `rollout=inprocess` config node."""
    node = compose_config(["rollout=inprocess", f"rollout.decode={decode}", f"rollout.merge_adapter={merge}",
                           f"rollout.compile_decode={compile_decode}"]).rollout
    return build(node, "rollout engine", spool_dir="unused", base_model_dir="unused", log_path="unused",
                 device="cpu", dtype="float32", lora_rank=4, seed=0, model=model)


def request(seed: int = 3, top_p: float = 1.0, weights: WeightsSpec | None = None) -> RolloutRequest:
    return RolloutRequest(request_id=f"r{seed}", weights=weights or WeightsSpec(kind="live", path=None, version=1),
                          prompt_token_ids=PROMPTS, n_samples_per_prompt=N_SAMPLES, max_new_tokens=MAX_NEW_TOKENS,
                          temperature=0.7, top_p=top_p, seed=seed, eos_token_id=EOS, pad_token_id=PAD)


def worker_engine_output(engine: HFEngine, req: RolloutRequest):
    return engine.generate(req.prompt_token_ids, req.n_samples_per_prompt, req.max_new_tokens, req.temperature,
                           req.top_p, req.seed, req.eos_token_id, req.pad_token_id)


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("base")
    tiny_model().save_pretrained(directory)
    return str(directory)


# top_p 1e-6 keeps only each step's most likely token: the greedy path
@pytest.mark.parametrize("merge", [True, False], ids=["merged", "branches"])
@pytest.mark.parametrize("top_p", [1.0, 1e-6], ids=["sampled", "greedy"])
@pytest.mark.parametrize("decode", ["static", "dynamic"])
def test_lora_policy_samples_what_the_worker_engine_samples_from_the_synced_adapter(base_dir, tmp_path, decode,
                                                                                     top_p, merge):
    policy = lora_policy(base_dir)
    worker = HFEngine(base_dir, decode=decode)
    worker.load_weights(WeightsSpec(kind="adapter", path=str(policy.save_adapter(tmp_path / "adapter")), version=1))
    base_tokens, _, _ = worker_engine_output(HFEngine(base_dir, decode=decode), request(top_p=top_p))
    engine = in_process_engine(policy.model, decode, merge)
    for seed in (3, 4):
        req = request(seed, top_p)
        want_tokens, want_logprobs, want_reasons = worker_engine_output(worker, req)
        got = engine.generate(req)
        assert engine.decode_info["loop"] == decode  # the static loop runs the peft model, no silent fallback
        assert got.token_ids == want_tokens and got.finish_reasons == want_reasons
        assert got.weights == req.weights and engine.served_weights == req.weights
        assert engine.last_merged == (3 * 2 if merge else 0)  # q, v and down of both layers, or none
        # the worker merged W + B A into its weights, the policy adds B (A x): equal up to float rounding
        for got_row, want_row in zip(got.logprobs, want_logprobs):
            assert got_row == pytest.approx(want_row, abs=1e-5)
    assert sum(map(len, want_tokens)) > len(want_tokens), "every row stopped at once: nothing compared"
    if top_p == 1.0:
        assert got.token_ids != base_tokens, "the adapter changes nothing: the comparison would not see it"


@pytest.mark.parametrize("decode", ["static", "dynamic"])
def test_full_policy_samples_exactly_what_the_worker_engine_samples_from_its_checkpoint(tmp_path, decode):
    policy = FullPolicy(tiny_model(), detach_value_hidden=True, critic=False)
    with torch.no_grad():  # as an update would: the trained weights leave the reference behind
        for parameter in policy.model.parameters():
            parameter.add_(torch.randn(parameter.shape, generator=torch.Generator().manual_seed(5)) * 0.05)
    policy.model.save_pretrained(tmp_path / "checkpoint")
    worker = HFEngine(str(tmp_path / "checkpoint"), decode=decode)
    engine = in_process_engine(policy.model, decode)
    req = request()
    want_tokens, want_logprobs, want_reasons = worker_engine_output(worker, req)
    got = engine.generate(req)
    # the same fp32 weights through the same kernels: bitwise the same
    assert (got.token_ids, got.logprobs, got.finish_reasons) == (want_tokens, want_logprobs, want_reasons)


class WeightShapedTensors(TorchDispatchMode):
    """Records every op output shaped like one of `weights` that does not share a weight's storage:
    a merged or copied weight matrix (views of the weights, such as a transpose, share it)."""

    def __init__(self, weights: list[torch.Tensor]):
        super().__init__()
        self.shapes = {tuple(w.shape) for w in weights if w.dim() == 2}
        self.storages = {w.untyped_storage().data_ptr() for w in weights}
        self.found: list[tuple[str, tuple]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(tensor, torch.Tensor) and tuple(tensor.shape) in self.shapes \
                    and tensor.untyped_storage().data_ptr() not in self.storages:
                self.found.append((str(func), tuple(tensor.shape)))
        return out


class ParametersRead(torch.overrides.TorchFunctionMode):
    """Collects every `nn.Parameter` handed to a torch function that computes a tensor (F.linear, F.embedding,
    a norm's multiply), not to a question about it (`data_ptr`, `.device`)."""

    def __init__(self):
        super().__init__()
        self.read: list[nn.Parameter] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if isinstance(out, torch.Tensor):
            self.read += [a for a in (*args, *kwargs.values()) if isinstance(a, nn.Parameter)]
        return out


@pytest.mark.parametrize("decode", ["static", "dynamic"])
def test_unmerged_engine_reads_the_trainers_own_weights_and_copies_none(base_dir, decode):
    policy = lora_policy(base_dir)
    engine = in_process_engine(policy.model, decode, merge=False)
    parameters = dict(policy.model.named_parameters())
    storage_before = {name: p.data_ptr() for name, p in parameters.items()}
    with ParametersRead() as reads, WeightShapedTensors(list(parameters.values())) as copies:
        engine.generate(request())
    assert engine.model is policy.model
    assert {name: p.data_ptr() for name, p in policy.model.named_parameters()} == storage_before
    own = {id(p) for p in parameters.values()}
    foreign = [tuple(p.shape) for p in reads.read if id(p) not in own]
    assert reads.read and not foreign, f"the forward read parameters the trainer lacks, shaped {foreign[:3]}"
    read = {id(p) for p in reads.read}
    names = {name for name, p in parameters.items() if id(p) in read}
    # the adapter ran as LoRA matmuls on the trainer's factors, beside the unmerged base weights
    assert any(".lora_A.policy." in name for name in names) and any(".lora_B.policy." in name for name in names)
    assert any(name.endswith("q_proj.base_layer.weight") for name in names)
    assert any(".modules_to_save.policy." in name for name in names)  # the trained norm, not the original
    assert not any(".original_module." in name for name in names)
    assert copies.found == [], f"weight-sized tensors made while sampling: {copies.found[:5]}"


@pytest.mark.parametrize("decode", ["static", "dynamic"])
def test_merged_engine_runs_no_lora_branch_and_puts_every_weight_back(base_dir, decode):
    policy = lora_policy(base_dir)
    engine = in_process_engine(policy.model, decode, merge=True)
    parameters = dict(policy.model.named_parameters())
    before = {name: (p.data_ptr(), p.detach().clone()) for name, p in parameters.items()}
    switches = {name: m._disable_adapters for name, m in policy.model.named_modules() if hasattr(m, "lora_A")}
    branch_calls = []  # the LoRA factors' own forwards (the merge reads their weights, it calls no factor)
    for name, module in policy.model.named_modules():
        if ".lora_A." in name or ".lora_B." in name:
            module.register_forward_hook(lambda module, args, out: branch_calls.append(module))
    with ParametersRead() as reads:
        engine.generate(request())
    names = {name for name, p in parameters.items() if id(p) in {id(p) for p in reads.read}}
    assert engine.last_merged == 6 and branch_calls == []  # one matmul per linear
    assert any(name.endswith("q_proj.base_layer.weight") for name in names)  # its tensor swapped for the merged
    assert any(".modules_to_save.policy." in name for name in names)  # the trained norm still serves
    for name, p in policy.model.named_parameters():  # the trainer's own tensors, bit for bit
        assert p.data_ptr() == before[name][0] and torch.equal(p, before[name][1]), name
    assert {name: m._disable_adapters for name, m in policy.model.named_modules() if hasattr(m, "lora_A")} == switches
    assert len(switches) == 6 and not any(switches.values())


def test_a_failed_merged_request_still_puts_every_weight_back(base_dir):
    policy = lora_policy(base_dir)
    engine = in_process_engine(policy.model, merge=True)
    before = {name: p.data_ptr() for name, p in policy.model.named_parameters()}

    def broken(*args, **kwargs):
        raise RuntimeError("out of memory")

    engine._sampler.generate = broken
    with pytest.raises(RuntimeError, match="out of memory"):
        engine.generate(request())
    assert {name: p.data_ptr() for name, p in policy.model.named_parameters()} == before
    assert not any(m._disable_adapters for m in policy.model.modules() if hasattr(m, "lora_A"))


def test_an_adapter_that_cannot_merge_samples_through_its_branches(base_dir, caplog):
    policy = lora_policy(base_dir)
    layer = next(m for m in policy.model.modules() if hasattr(m, "lora_A"))
    layer.fan_in_fan_out = True  # a layout the merge does not handle: every layer stays unmerged
    engine = in_process_engine(policy.model, merge=True)
    with caplog.at_level("WARNING"):
        got = engine.generate(request())
    assert engine.last_merged == 0 and "unmerged (a LoRA bias, fan_in_fan_out" in caplog.text
    layer.fan_in_fan_out = False
    assert got.token_ids == in_process_engine(policy.model).generate(request()).token_ids


@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
def test_samples_without_dropout_puts_training_flags_back_and_runs_compiled_layers_eagerly(base_dir, training):
    policy = lora_policy(base_dir, dropout=0.5)
    policy.enable_gradient_checkpointing()
    # train: every module training, LoRA dropout live; eval: as the trainer leaves it, dropout off but the
    # checkpointed layers marked training
    policy.train(training)
    flags = {name: module.training for name, module in policy.model.named_modules()}
    assert all(flags.values()) if training else (any(flags.values()) and not all(flags.values()))
    layers = policy.model.get_base_model().model.layers

    def compiled_call(*args, **kwargs):
        raise AssertionError("a compiled layer ran while sampling")

    for layer in layers:
        layer._compiled_call_impl = compiled_call  # what nn.Module.compile sets
    result = in_process_engine(policy.model).generate(request())
    plain = in_process_engine(lora_policy(base_dir, dropout=0.5).model).generate(request())  # eval, never checkpointed
    assert (result.token_ids, result.logprobs) == (plain.token_ids, plain.logprobs)
    assert {name: module.training for name, module in policy.model.named_modules()} == flags
    assert all(layer._compiled_call_impl is compiled_call for layer in layers)


@pytest.mark.parametrize("merge", [True, False], ids=["merged", "branches"])
def test_compiled_decode_step_samples_what_the_eager_step_samples_on_the_lora_policy(base_dir, merge,
                                                                                     decode_step_graphs):
    """rollout.compile_decode=true from the config node: the decode step of the peft model (adapter merged or
    through its branches) is traced by dynamo and samples the eager engine's tokens; merged, its projections run
    fused (`compiled_decode.fused_layer_forward`), with the branches the layer's own forward."""
    graphs = decode_step_graphs.graphs
    policy = lora_policy(base_dir)
    eager = in_process_engine(policy.model, merge=merge).generate(request())
    assert not graphs
    compiled = in_process_engine(policy.model, merge=merge, compile_decode=True).generate(request())
    assert graphs, "compile_decode=true traced nothing: the option did not reach the decoder"
    # merged: the fused projections (q/k/v, output, gate/up, down); branches: the layer's own forward and its LoRA
    linears = [node for node in graphs[0].graph.nodes if node.target is torch._C._nn.linear]
    assert len(linears) == 4 if merge else len(linears) > 7
    assert compiled.token_ids == eager.token_ids and compiled.finish_reasons == eager.finish_reasons
    for got_row, want_row in zip(compiled.logprobs, eager.logprobs):
        assert got_row == pytest.approx(want_row, abs=1e-5)


def test_kv_cache_is_released_after_each_request(base_dir):
    engine = in_process_engine(lora_policy(base_dir).model)
    engine.generate(request())
    assert engine.decode_info["loop"] == "static" and engine._sampler.decoder is None


def test_weights_it_cannot_serve_and_a_switched_adapter_are_refused(base_dir, tmp_path):
    policy = lora_policy(base_dir)
    engine = in_process_engine(policy.model)
    with pytest.raises(RolloutWorkerError, match="rollout.sync=none"):
        engine.generate(request(weights=WeightsSpec(kind="checkpoint", path=str(tmp_path), version=1)))
    policy.model.add_adapter("prm", policy.model.peft_config["policy"])
    policy.model.set_adapter("prm")  # what a PRM scorer that forgot to switch back would leave
    with pytest.raises(RolloutWorkerError, match="active adapter is 'prm'"):
        engine.generate(request())
    policy.model.set_adapter("policy")
    assert engine.generate(request()).token_ids


def test_worker_engines_refuse_live_weights(base_dir):
    engine = HFEngine(base_dir)
    with pytest.raises(ValueError, match="rollout=inprocess"):
        engine.load_weights(WeightsSpec(kind="live", path=None, version=1))
