"""Tests of the built-in engine, in process, on a tiny Mistral model saved to a temp dir.

The central check: the engine's sampling logprobs (prefill + KV-cached decode over left-padded
rows) equal the logprobs of ONE full forward pass over prompt + response (right-padded, no
cache) at the same temperature. The PPO ratio tripwire relies on it.
"""

from __future__ import annotations

import pytest
import torch

peft = pytest.importorskip("peft")
from transformers import AutoModelForCausalLM, MistralConfig, MistralForCausalLM  # noqa: E402

from prmppo.rollout.hf_engine import HFEngine, find_adapter_dir  # noqa: E402
from prmppo.rollout.protocol import WeightsSpec  # noqa: E402

EOS, PAD = 2, 0
PROMPTS = [[5, 6, 7], [8, 9, 10, 11, 12, 13, 14], [3]]  # different lengths: left padding matters


def tiny_config() -> MistralConfig:
    return MistralConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=32, max_position_embeddings=128,
    )


def save_tiny_model(directory, seed: int, eos_logit_scale: float | None = None) -> str:
    """Save a random tiny model; with `eos_logit_scale`, EOS's logit is ~5.7 * scale, others 0.

    The EOS variant zeroes every block's output projections (the residual stream is the token
    embedding), puts a large constant in embedding dim 0, and reads only dim 0 into EOS's logit,
    so p(EOS) is the same at every position and set by the scale.
    """
    torch.manual_seed(seed)
    model = MistralForCausalLM(tiny_config())
    if eos_logit_scale is not None:
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.o_proj.weight.zero_()
                layer.mlp.down_proj.weight.zero_()
            model.model.embed_tokens.weight[:, 0] = 10.0  # after RMSNorm dim 0 ~ sqrt(32) ~ 5.66
            model.lm_head.weight.zero_()
            model.lm_head.weight[EOS, 0] = eos_logit_scale
    model.save_pretrained(directory)
    return str(directory)


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("base"), seed=0)


@pytest.fixture(scope="module")
def engine(base_dir):
    return HFEngine(base_dir)


def generate(engine, seed=0, n=2, max_new_tokens=8, temperature=0.7, top_p=1.0, prompts=PROMPTS, pad=PAD):
    return engine.generate(prompts, n, max_new_tokens, temperature, top_p, seed, EOS, pad)


@torch.no_grad()
def full_forward_logprobs(model, prompts, n, responses, temperature) -> list[torch.Tensor]:
    """Logprobs of each response token from one right-padded forward pass without a cache."""
    rows = [prompt for prompt in prompts for _ in range(n)]
    sequences = [row + response for row, response in zip(rows, responses)]
    length = max(len(seq) for seq in sequences)
    input_ids = torch.full((len(sequences), length), PAD)  # [B, L]
    attention_mask = torch.zeros((len(sequences), length), dtype=torch.long)  # [B, L]
    for index, seq in enumerate(sequences):
        input_ids[index, : len(seq)] = torch.tensor(seq)
        attention_mask[index, : len(seq)] = 1
    logits = model.eval()(input_ids=input_ids, attention_mask=attention_mask).logits.float()  # [B, L, V]
    logprobs = torch.log_softmax(logits / temperature, dim=-1)
    out = []
    for index, (row, response) in enumerate(zip(rows, responses)):
        # the logits at position j predict token j + 1: response token t sits at len(row) + t
        positions = logprobs[index, len(row) - 1 : len(row) - 1 + len(response)]  # [T, V]
        out.append(positions.gather(-1, torch.tensor(response)[:, None]).squeeze(-1))
    return out


def assert_logprobs_match(model, prompts, n, tokens, logprobs, temperature):
    expected = full_forward_logprobs(model, prompts, n, tokens, temperature)
    for row, (want, got) in enumerate(zip(expected, logprobs)):
        assert torch.allclose(torch.tensor(got), want, atol=1e-4), f"row {row}: {got} vs {want}"


@pytest.mark.parametrize("n, top_p", [(1, 1.0), (2, 1.0), (2, 0.8)])
def test_logprobs_equal_full_forward_pass(engine, base_dir, n, top_p):
    tokens, logprobs, reasons = generate(engine, n=n, top_p=top_p, max_new_tokens=10)
    assert len(tokens) == len(PROMPTS) * n
    model = AutoModelForCausalLM.from_pretrained(base_dir, local_files_only=True)
    # top_p < 1 still reports the untruncated tempered logprob
    assert_logprobs_match(model, PROMPTS, n, tokens, logprobs, temperature=0.7)
    for row_tokens, reason in zip(tokens, reasons):
        assert reason == ("stop" if row_tokens[-1] == EOS else "length")


def test_eos_overwhelmingly_likely_stops_every_row_at_once(tmp_path):
    engine = HFEngine(save_tiny_model(tmp_path, seed=0, eos_logit_scale=5.0))  # p(EOS) ~ 1
    tokens, logprobs, reasons = generate(engine, max_new_tokens=6)
    assert tokens == [[EOS]] * 6
    assert reasons == ["stop"] * 6
    assert all(len(row) == 1 and row[0] > -1e-3 for row in logprobs)


def test_rows_stop_at_their_first_eos_and_match_full_forward(tmp_path):
    # scale 0.41: EOS logit ~2.34 vs 31 zeros -> p(EOS) ~ 0.25 per step; pad == EOS as in Mistral
    model_dir = save_tiny_model(tmp_path, seed=0, eos_logit_scale=0.41)
    engine = HFEngine(model_dir)
    tokens, logprobs, reasons = generate(engine, n=4, max_new_tokens=6, temperature=1.0, pad=EOS)
    assert set(reasons) == {"stop", "length"}, "seed gives no mix of stopped and truncated rows"
    for row_tokens, reason in zip(tokens, reasons):
        if reason == "stop":
            assert row_tokens.index(EOS) == len(row_tokens) - 1  # nothing after the first EOS
        else:
            assert len(row_tokens) == 6 and EOS not in row_tokens
    model = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True)
    assert_logprobs_match(model, PROMPTS, 4, tokens, logprobs, temperature=1.0)


def test_same_seed_same_samples_other_seed_other_samples(engine):
    first, second, other = generate(engine, seed=7), generate(engine, seed=7), generate(engine, seed=8)
    assert first == second
    assert first[0] != other[0]


def test_tiny_top_p_samples_the_argmax(engine, base_dir):
    tokens, _, _ = generate(engine, top_p=1e-6, max_new_tokens=6)
    assert tokens == generate(engine, top_p=1e-6, max_new_tokens=6, seed=99)[0]  # seed-independent
    model = AutoModelForCausalLM.from_pretrained(base_dir, local_files_only=True)
    # greedy: each token's logprob is the row maximum (tolerant to exact ties)
    rows = [prompt for prompt in PROMPTS for _ in range(2)]
    with torch.no_grad():
        for row, response in zip(rows, tokens):
            logits = model(input_ids=torch.tensor([row + response])).logits[0]  # [L, V]
            logits = logits[len(row) - 1 : -1]  # [T, V]: the positions that predict the response
            chosen = logits.gather(-1, torch.tensor(response)[:, None]).squeeze(-1)
            assert torch.allclose(chosen, logits.max(dim=-1).values, atol=1e-5)


def make_adapter(base_dir, directory, seed: int, adapter_name: str = "default", modules_to_save=None):
    """Save a random (non-identity) LoRA adapter; returns the peft model that made it."""
    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(base_dir, local_files_only=True)
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False,
                             modules_to_save=modules_to_save)
    model = peft.get_peft_model(base, config, adapter_name=adapter_name)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "modules_to_save" in name:
                parameter.add_(torch.randn_like(parameter) * 0.1)  # a trained copy differs from the base
    model.save_pretrained(directory)
    return model.eval()


def test_adapter_sync_changes_outputs_and_base_restores_them(base_dir, tmp_path):
    engine = HFEngine(base_dir)
    base_out = generate(engine, seed=3)
    first = make_adapter(base_dir, tmp_path / "a1", seed=1)  # top-level layout
    second = make_adapter(base_dir, tmp_path / "a2", seed=2, adapter_name="policy")  # a2/policy/
    assert find_adapter_dir(tmp_path / "a2") == tmp_path / "a2" / "policy"

    adapters = [(tmp_path / "a1", first), (tmp_path / "a2", second)]
    for version, (directory, peft_model) in enumerate(adapters, start=1):
        spec = WeightsSpec("adapter", str(directory), version)
        engine.load_weights(spec)
        assert engine.served_weights == spec
        assert not any("lora_" in name for name, _ in engine.model.named_parameters())  # merged
        tokens, logprobs, _ = generate(engine, seed=3)
        assert tokens != base_out[0]
        assert_logprobs_match(peft_model, PROMPTS, 2, tokens, logprobs, temperature=0.7)

    engine.load_weights(WeightsSpec("base", None, 3))
    pristine = AutoModelForCausalLM.from_pretrained(base_dir, local_files_only=True).state_dict()
    for name, value in engine.model.state_dict().items():
        assert torch.equal(value, pristine[name]), f"{name} is not the base's exactly"
    restored = generate(engine, seed=3)
    assert restored[0] == base_out[0] and restored[2] == base_out[2]
    flat = [torch.tensor(sum(out[1], [])) for out in (restored, base_out)]
    assert torch.allclose(flat[0], flat[1], atol=1e-6)


def test_served_adapter_logits_equal_the_merged_checkpoint(base_dir, tmp_path):
    engine = HFEngine(base_dir)
    storage = [parameter.data_ptr() for parameter in engine.model.parameters()]
    inputs = torch.tensor([[5, 6, 7, 8, 9, 10]])
    for version, seed in enumerate((1, 2), start=1):  # the second merge starts from the restored base
        adapter = make_adapter(base_dir, tmp_path / f"a{seed}", seed=seed, modules_to_save=["model.norm"])
        merged = adapter.merge_and_unload()
        engine.load_weights(WeightsSpec("adapter", str(tmp_path / f"a{seed}"), version))
        with torch.no_grad():
            assert torch.allclose(engine.model(inputs).logits, merged(inputs).logits, atol=1e-6)
        # merged in place, the saved norm included: the static decoder's buffers and graphs stay valid
        assert [parameter.data_ptr() for parameter in engine.model.parameters()] == storage
    engine.load_weights(WeightsSpec("base", None, 3))
    pristine = AutoModelForCausalLM.from_pretrained(base_dir, local_files_only=True).state_dict()
    assert all(torch.equal(value, pristine[name]) for name, value in engine.model.state_dict().items())


def test_checkpoint_load_equals_loading_that_dir(base_dir, tmp_path):
    checkpoint_dir = save_tiny_model(tmp_path / "ckpt", seed=1)
    engine = HFEngine(base_dir)
    base_tokens = generate(engine, seed=4)[0]
    resident, decoder = engine.model, engine._sampler.decoder
    engine.load_weights(WeightsSpec("checkpoint", checkpoint_dir, 1))
    assert engine.model is resident and engine._sampler.decoder is decoder  # copied in place: cache and graphs kept
    synced = generate(engine, seed=4)
    assert engine._sampler.decoder is decoder
    assert synced == generate(HFEngine(checkpoint_dir), seed=4)
    assert synced[0] != base_tokens
    engine.load_weights(WeightsSpec("base", None, 2))  # back from a checkpoint: base reloaded
    assert generate(engine, seed=4)[0] == base_tokens


def test_checkpoint_of_another_shape_is_loaded_whole(base_dir, tmp_path):
    torch.manual_seed(2)
    wider = MistralForCausalLM(MistralConfig(**{**tiny_config().to_dict(), "intermediate_size": 48}))
    wider.save_pretrained(tmp_path / "wider")
    engine = HFEngine(base_dir)
    resident = engine.model
    engine.load_weights(WeightsSpec("checkpoint", str(tmp_path / "wider"), 1))
    assert engine.model is not resident and engine.model.config.intermediate_size == 48
    assert generate(engine, seed=4) == generate(HFEngine(str(tmp_path / "wider")), seed=4)


def test_failed_load_serves_nothing_until_a_good_load(base_dir, tmp_path):
    engine = HFEngine(base_dir)
    with pytest.raises(FileNotFoundError, match="adapter_config.json"):
        engine.load_weights(WeightsSpec("adapter", str(tmp_path), 1))
    assert engine.served_weights is None
    with pytest.raises(RuntimeError, match="no weights are served"):
        generate(engine)
    engine.load_weights(WeightsSpec("base", None, 2))
    assert len(generate(engine)[0]) == 6


def test_refuses_out_of_vocab_prompt_and_bad_dtype(engine, base_dir):
    with pytest.raises(ValueError, match=r"prompt_token_ids\[1\] holds id 40 >= vocab size 32"):
        generate(engine, prompts=[[1], [40]])
    with pytest.raises(ValueError, match="dtype='fp32' is invalid"):
        HFEngine(base_dir, dtype="fp32")
    with pytest.raises(ValueError, match="decode='fast' is invalid"):
        HFEngine(base_dir, decode="fast")
    with pytest.raises(ValueError, match="done_check_every=0 is invalid"):
        HFEngine(base_dir, done_check_every=0)
