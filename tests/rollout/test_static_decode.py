"""The static decode path against the dynamic-cache loop, and its pure helpers.

Both loops draw the same noise (`rollout/sampling.py`), so for one seed they must sample the same
tokens; their logprobs differ only by float rounding (the static cache attends over masked
slots, the dynamic one over a shorter cache): within 1e-5 here, in float32. `done_check_every=1`
and a small `prefill_tokens` make the static loop drop finished rows and prefill in several
chunks even at this tiny size.
"""

from __future__ import annotations

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from prmppo.rollout import compiled_decode, static_decode
from prmppo.rollout.hf_engine import HFEngine
from prmppo.rollout.sampling import next_tokens, sample_tokens
from prmppo.rollout.static_decode import bucket_sizes, prefill_chunks
from rollout.test_hf_engine import EOS, PAD, PROMPTS, save_tiny_model


def save_tiny_qwen2(directory) -> str:
    torch.manual_seed(0)
    config = Qwen2Config(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=32, max_position_embeddings=256)
    Qwen2ForCausalLM(config).save_pretrained(directory)
    return str(directory)


@pytest.fixture(scope="module", params=["mistral-eos", "qwen2"])
def model_dir(request, tmp_path_factory):
    directory = tmp_path_factory.mktemp(request.param)
    if request.param == "qwen2":
        return save_tiny_qwen2(directory)
    return save_tiny_model(directory, seed=0, eos_logit_scale=0.41)  # p(EOS) ~ 0.25 per step


@pytest.mark.parametrize("temperature, top_p", [(1.0, 1.0), (0.7, 0.8), (1.0, 1e-6)])  # the last: greedy
def test_static_samples_what_dynamic_samples(model_dir, temperature, top_p, monkeypatch):
    compactions = []
    original = static_decode.StaticDecoder.compact
    monkeypatch.setattr(static_decode.StaticDecoder, "compact",
                        lambda self, keep: compactions.append(len(keep)) or original(self, keep))
    prompts = PROMPTS + [[4, 4, 5, 6, 7, 8]]
    static = HFEngine(model_dir, decode="static", done_check_every=1, prefill_tokens=8)
    dynamic = HFEngine(model_dir, decode="dynamic")
    for seed in (0, 1):
        args = (prompts, 4, 12, temperature, top_p, seed, EOS, PAD)
        fast, slow = static.generate(*args), dynamic.generate(*args)
        assert fast[0] == slow[0] and fast[2] == slow[2]
        for got, want in zip(fast[1], slow[1]):
            assert torch.allclose(torch.tensor(got), torch.tensor(want), atol=1e-5)
    if "eos" in model_dir and top_p > 0.5:
        assert compactions, "no rows were dropped: the test does not exercise compaction"


def test_static_decoder_is_kept_across_requests_and_rebuilt_for_new_weights(tmp_path):
    engine = HFEngine(save_tiny_qwen2(tmp_path / "m"), decode="static")
    first = engine.generate(PROMPTS, 2, 5, 1.0, 1.0, 3, EOS, PAD)
    decoder = engine._sampler.decoder
    assert decoder is not None and engine.generate(PROMPTS, 2, 5, 1.0, 1.0, 3, EOS, PAD) == first
    assert engine._sampler.decoder is decoder  # same rows, cache long enough: reused
    engine.generate(PROMPTS, 3, 5, 1.0, 1.0, 3, EOS, PAD)
    assert engine._sampler.decoder is not decoder  # other row count: rebuilt
    assert engine.decode_info == {"loop": "static", "cuda_graph_buckets": [],  # no graphs on a CPU
                                  "decode_attention": "prmppo_grouped"}


def test_exponential_race_samples_from_the_distribution():
    generator = torch.Generator().manual_seed(0)
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]])).repeat(40_000, 1)  # [N, 4]
    tokens, logprobs = next_tokens(logits, 1.0, 1.0, generator)
    frequencies = torch.bincount(tokens, minlength=4).float() / len(tokens)
    assert torch.allclose(frequencies, torch.tensor([0.5, 0.3, 0.15, 0.05]), atol=0.01)
    assert torch.allclose(logprobs, logits.gather(-1, tokens[:, None]).squeeze(-1), atol=1e-6)
    # top_p=0.7 keeps {0.5, 0.3} (mass before the third is 0.8 >= 0.7): the others never come
    truncated, _ = sample_tokens(logits, 1.0, 0.7, torch.empty_like(logits).exponential_(generator=generator))
    assert set(truncated.tolist()) == {0, 1}


def test_a_rows_sample_does_not_depend_on_its_batch_neighbours():
    logits = torch.randn(6, 10, generator=torch.Generator().manual_seed(1))
    full, _ = next_tokens(logits, 1.0, 1.0, torch.Generator().manual_seed(5))
    order = torch.tensor([4, 1])  # a compacted batch of rows 4 and 1
    part, _ = next_tokens(logits[order], 1.0, 1.0, torch.Generator().manual_seed(5), order, 6)
    assert part.tolist() == full[order].tolist()


def test_bucket_sizes_and_prefill_chunks():
    assert bucket_sizes(6) == [6, 4, 2, 1]
    assert bucket_sizes(8) == [8, 4, 2, 1]
    # lengths sorted longest first, budget 10 padded tokens: [5, 5] | [4, 3] | [3, 3, 2] | [1]
    assert prefill_chunks([5, 5, 4, 3, 3, 3, 2, 1], 10) == [(0, 2), (2, 4), (4, 7), (7, 8)]
    assert prefill_chunks([20, 1], 10) == [(0, 1), (1, 2)]  # a row longer than the budget still runs


def test_unsupported_models_are_named_and_fall_back_to_the_dynamic_loop(tmp_path):
    engine = HFEngine(save_tiny_model(tmp_path, seed=0), decode="static")
    engine.model.config.sliding_window = 16  # shorter than the cache: the 4D mask could not apply it
    assert "sliding window 16 < 128 cache slots" in static_decode.unsupported_reason(engine.model, 128)
    engine.model.config._attn_implementation = "flash_attention_2"
    assert "flash_attention_2" in static_decode.unsupported_reason(engine.model, 128)
    engine.model.config._attn_implementation = "sdpa"
    tokens, _, _ = engine.generate(PROMPTS, 2, 4, 1.0, 1.0, 0, EOS, PAD)
    assert engine._sampler.decoder is None and len(tokens) == 6
    assert engine.decode_info == {"loop": "dynamic", "cuda_graph_buckets": [], "decode_attention": None}


class ReplayOnCPU:
    """Stands in for a captured CUDA graph: replay recomputes the step into one fixed output tensor,
    as a real replay overwrites its captured output; what the loop reads must survive that."""

    def __init__(self, decoder, bucket):
        self.decoder, self.bucket = decoder, bucket
        self.output = decoder._decode_forward(bucket).clone()  # the capture's warm-up runs the step too

    def replay(self):
        self.output.copy_(self.decoder._decode_forward(self.bucket))


def test_graph_replay_bookkeeping_matches_eager_steps(tmp_path, monkeypatch):
    captured = []

    def fake_capture(decoder, bucket):
        captured.append(bucket)
        graph = ReplayOnCPU(decoder, bucket)
        return graph, graph.output

    monkeypatch.setattr(static_decode.StaticDecoder, "_capture", fake_capture)
    model = HFEngine(save_tiny_model(tmp_path, seed=0, eos_logit_scale=0.41)).model
    rows = [prompt for prompt in PROMPTS for _ in range(4)]
    outputs = []
    for use_graphs in (False, True):
        decoder = static_decode.StaticDecoder(model, len(rows), 128, use_graphs=False, prefill_tokens=8)
        decoder.use_graphs = use_graphs  # the pool handle needs CUDA; ReplayOnCPU needs none
        generator = torch.Generator().manual_seed(3)
        with torch.inference_mode():
            outputs.append(static_decode.sample_static(decoder, rows, 10, 1.0, 1.0, generator, EOS, PAD, 1))
    assert len(set(captured)) > 1, "graphs of one bucket only: compaction was not exercised"
    for eager, replayed in zip(*outputs):
        assert torch.equal(eager, replayed)


def test_prefill_runs_each_prompt_once_and_copies_it_to_its_samples(tmp_path, monkeypatch):
    model = HFEngine(save_tiny_qwen2(tmp_path / "m")).model
    fed_rows = []
    original = static_decode.StaticDecoder._forward
    def counting_forward(self, input_ids, *args):
        fed_rows.append(len(input_ids))
        return original(self, input_ids, *args)

    monkeypatch.setattr(static_decode.StaticDecoder, "_forward", counting_forward)
    distinct = sorted(PROMPTS, key=len, reverse=True)  # [7, 3, 1 tokens]
    rows = [prompt for prompt in distinct for _ in range(3)]  # 3 samples each, neighbours
    once, each = (static_decode.StaticDecoder(model, len(rows), 128, use_graphs=False, prefill_tokens=8)
                  for _ in range(2))
    with torch.inference_mode():
        logits = once.prefill(rows, PAD)  # [9, V]
        assert sum(fed_rows) == 3  # the 3 prompts, not the 9 rows
        want = each.prefill(distinct, PAD)  # [3, V]: rows 0..2 of `each` hold the 3 prompts
    source = torch.tensor([0, 0, 0, 1, 1, 1, 2, 2, 2])
    torch.testing.assert_close(logits, want[source])
    for got_keys, want_keys in zip(once.keys + once.values, each.keys + each.values):
        torch.testing.assert_close(got_keys[:9, :, :7], want_keys[source, :, :7])
    assert torch.equal(once.valid[:9], each.valid[source])
    assert once.positions[:9, 0].tolist() == [7, 7, 7, 3, 3, 3, 1, 1, 1]


def test_compiled_decode_step_samples_what_the_eager_step_samples_with_one_graph(tmp_path, monkeypatch,
                                                                                  decode_step_graphs):
    """rollout.compile_decode: every decoder layer, every bucket of 2 rows or more and every cache length run one
    dynamo graph, a layer's (a graph more would be a compile in the middle of a run, or a layer traced apart at
    every start-up); the tokens are those of the eager step."""
    model = HFEngine(save_tiny_model(tmp_path, seed=0, eos_logit_scale=0.41)).model
    buckets, outputs, layers_called = [], {False: [], True: []}, set()
    original_step, original_call = static_decode.StaticDecoder.step, compiled_decode._LayerCall.__call__
    monkeypatch.setattr(static_decode.StaticDecoder, "step",
                        lambda self, tokens, bucket: buckets.append(bucket) or original_step(self, tokens, bucket))
    monkeypatch.setattr(compiled_decode._LayerCall, "__call__",
                        lambda self, *args, **kwargs: layers_called.add(id(self.layer))
                        or original_call(self, *args, **kwargs))
    for compile_decode in (False, True):
        for samples, slots in ((4, 128), (3, 256)):  # two batch sizes, two cache lengths
            rows = [prompt for prompt in PROMPTS + [[4, 4, 5, 6, 7, 8]] for _ in range(samples)]
            decoder = static_decode.StaticDecoder(model, len(rows), slots, use_graphs=False, prefill_tokens=8,
                                                  compile_decode=compile_decode)
            with torch.inference_mode():
                outputs[compile_decode].append(static_decode.sample_static(
                    decoder, rows, 12, 1.0, 1.0, torch.Generator().manual_seed(0), EOS, PAD, 1))
    assert len({bucket for bucket in buckets if bucket > 1}) >= 3, "too few buckets to show the graph is shared"
    assert layers_called == {id(layer) for layer in model.model.layers}  # each layer's step ran compiled
    assert len(decode_step_graphs.graphs) == 1  # one graph for every layer, bucket and cache length
    for (tokens, logprobs, done), (want_tokens, want_logprobs, want_done) in zip(outputs[True], outputs[False]):
        assert torch.equal(tokens, want_tokens) and torch.equal(done, want_done)
        torch.testing.assert_close(logprobs, want_logprobs)


def test_compiled_decode_refuses_a_model_without_a_decoder_layer_list():
    """rollout.compile_decode compiles a decoder layer: a model whose decoder keeps its layers elsewhere (GPT-2's
    `h`) is refused when the decoder is built, naming the option, before any request."""
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(n_embd=16, n_layer=2, n_head=2, vocab_size=40, n_positions=64))
    static_decode.StaticDecoder(model, 2, 16, use_graphs=False, prefill_tokens=8)  # eager: served
    with pytest.raises(ValueError, match="GPT2LMHeadModel has no decoder `layers` list .*rollout.compile_decode=false"):
        static_decode.StaticDecoder(model, 2, 16, use_graphs=False, prefill_tokens=8, compile_decode=True)


def _tiny_llama_family(kind: str):
    """A random two-layer model of `kind` (Qwen2 has q/k/v biases; Llama and Mistral have none), GQA 4 -> 2 heads."""
    from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM

    torch.manual_seed(1)
    shape = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=40, max_position_embeddings=256)
    config_class, model_class = {"qwen2": (Qwen2Config, Qwen2ForCausalLM), "llama": (LlamaConfig, LlamaForCausalLM),
                                 "mistral": (MistralConfig, MistralForCausalLM)}[kind]
    model = model_class(config_class(**shape)).eval()
    with torch.no_grad():  # biases away from 0, so that a bias dropped or misplaced shows
        for module in model.modules():
            if isinstance(module, torch.nn.Linear) and module.bias is not None:
                module.bias.normal_()
    return model


@pytest.mark.parametrize("kind", ["qwen2", "llama", "mistral"])
def test_fused_layer_forward_is_the_layers_own_forward(kind):
    """The compiled step's fused layer (q/k/v as one matmul, gate/up as one) gives the output and writes the KV
    buffers that the layer's own forward does with the same cache, for a decode query and a 3-query chunk."""
    from prmppo.rollout import grouped_attention

    model = _tiny_llama_family(kind)
    layers = model.model.layers
    fused = compiled_decode.FusedProjections(layers)
    assert fused.refresh() is None
    rows, slots_total, kv_heads, head_dim = 3, 16, 2, 8
    grouped_attention.register()
    for q_length in (1, 3):
        hidden = torch.randn(rows, q_length, 32)
        slots = torch.arange(5, 5 + q_length)  # [q]
        positions = torch.tensor([[4 + i for i in range(q_length)]] * rows)  # [b, q]
        keep = torch.rand(rows, q_length, slots_total) < 0.7
        keep[:, torch.arange(q_length), slots] = True
        mask = torch.zeros(keep.shape).masked_fill(~keep, torch.finfo(torch.float32).min)[:, None]  # [b, 1, q, S]
        position_embeddings = model.model.rotary_emb(hidden, positions)
        for index, layer in enumerate(layers):
            start = torch.randn(rows, kv_heads, slots_total, head_dim)
            want_keys, want_values = start.clone(), start.clone() * 2
            got_keys, got_values = want_keys.clone(), want_values.clone()
            with torch.no_grad(), grouped_attention.attention_implementation(model, grouped_attention.NAME):
                want = layer(hidden, attention_mask=mask, position_embeddings=position_embeddings,
                             position_ids=positions, **{static_decode._cache_kwarg(model):
                                                        compiled_decode.LayerSlotCache(want_keys, want_values, slots)})
                got = compiled_decode.fused_layer_forward(layer, hidden, mask, position_embeddings, got_keys,
                                                          got_values, slots, *fused.weights[index])
            want = want[0] if isinstance(want, tuple) else want
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(got_keys, want_keys, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(got_values, want_values, rtol=1e-5, atol=1e-5)
            assert not torch.equal(got_keys, start)  # the step wrote its keys


def test_compiled_decode_step_runs_fused_projections_and_samples_what_the_eager_step_samples(decode_step_graphs):
    """A Qwen2 model's compiled decode step traces the fused layer (one graph for both layers) and samples the
    eager step's tokens; a decoder kept across requests samples with the weights of the request, not with the
    stacked copies of the one before (the copies are refreshed at each prefill)."""
    model = _tiny_llama_family("qwen2")
    rows = [prompt for prompt in PROMPTS for _ in range(3)]

    def sample(decoder):
        with torch.inference_mode():
            return static_decode.sample_static(decoder, rows, 10, 1.0, 1.0, torch.Generator().manual_seed(0),
                                               EOS, PAD, 1)

    kept = static_decode.StaticDecoder(model, len(rows), 128, use_graphs=False, prefill_tokens=8, compile_decode=True)
    for request in range(2):
        if request:  # the trainer's update: the same tensors, new values
            with torch.no_grad():
                for layer in model.model.layers:
                    layer.self_attn.k_proj.weight.mul_(-1.5)
                    layer.mlp.up_proj.weight.add_(0.3)
                    layer.self_attn.q_proj.bias.add_(1.0)
        eager = static_decode.StaticDecoder(model, len(rows), 128, use_graphs=False, prefill_tokens=8)
        assert kept.fits(model, len(rows), 128)
        tokens, logprobs, done = sample(kept)
        want_tokens, want_logprobs, want_done = sample(eager)
        assert torch.equal(tokens, want_tokens) and torch.equal(done, want_done)
        torch.testing.assert_close(logprobs, want_logprobs, rtol=1e-5, atol=1e-5)
    assert kept.fusion_refusal is None and len(decode_step_graphs.graphs) == 1
    linears = [node for node in decode_step_graphs.graphs[0].graph.nodes if node.target is torch._C._nn.linear]
    assert len(linears) == 4  # q/k/v, the output projection, gate/up, down: the layer's own forward has 7


def test_fused_projections_refuse_an_unmerged_lora_branch():
    """A projection whose LoRA branch runs is not its base weight: the fused step is refused for it (the layer's
    own forward runs), and accepted once the adapter is disabled, as the merged sampling path leaves it."""
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(_tiny_llama_family("qwen2"), LoraConfig(r=4, target_modules=["k_proj", "up_proj"]))
    layers = compiled_decode.decoder_layers(model.get_base_model())
    fused = compiled_decode.FusedProjections(layers)
    assert "LoRA branch runs unmerged" in fused.refresh() and fused.weights is None
    with model.disable_adapter():
        assert fused.refresh() is None
        k_proj = layers[0].self_attn.k_proj
        assert torch.equal(fused.weights[0][0][32:48], k_proj.get_base_layer().weight)
    assert fused.refresh() is not None and fused.weights is None
