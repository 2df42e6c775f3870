"""The vLLM engine through the real worker process in its own environment, checked against transformers.

Every logprob the engine returns is compared with a teacher-forced forward pass of the weights it
claims to serve (base, merged checkpoint, LoRA adapter) in this (the trainer's) interpreter, so a
sync that did not take, or a prefix cache that kept KV blocks of the old weights, shows as a gap.
One worker is shared by the tests that leave it healthy; its start costs seconds.
"""

from __future__ import annotations

import sys

import pytest
import torch

peft = pytest.importorskip("peft")
from transformers import AutoModelForCausalLM, MistralConfig, MistralForCausalLM  # noqa: E402

from prmppo.guards.gates import GateError, check_rollout_engine  # noqa: E402
from prmppo.config.schema import RolloutConfig  # noqa: E402
from prmppo.rollout.client import RolloutClient, probe_engine_python  # noqa: E402
from prmppo.rollout.protocol import EngineStartError, RolloutRequest, RolloutWorkerError, WeightsSpec  # noqa: E402

# the long prompt fills a KV block (128 tokens on CPU), so the prefix cache holds it between requests
PROMPTS = [[1, 5, 6, 7], [1, 8, 9, 10, 11], [1] + [4 + i % 27 for i in range(150)]]
EOS = 2
TEMPERATURE = 0.7
# float32 on both sides: what is left is summation order (the hf engine's own gap is ~4e-7)
MAX_GAP = 1e-4


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    """A tiny Mistral (head size 32: vLLM's CPU attention needs one of its sizes), two LoRA adapters
    on it and the first adapter merged into a checkpoint."""
    root = tmp_path_factory.mktemp("models")
    torch.manual_seed(0)
    config = MistralConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                           num_key_value_heads=1, vocab_size=32, max_position_embeddings=256, eos_token_id=EOS,
                           bos_token_id=1, pad_token_id=0, tie_word_embeddings=True)
    MistralForCausalLM(config).save_pretrained(root / "base")
    for index in (1, 2):
        torch.manual_seed(index)
        base = AutoModelForCausalLM.from_pretrained(root / "base", local_files_only=True)
        lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"],
                               init_lora_weights=False)
        model = peft.get_peft_model(base, lora, adapter_name="policy")
        with torch.no_grad():  # peft's non-default init is small: make the adapter move logprobs visibly
            for name, parameter in model.named_parameters():
                if "lora_B" in name:
                    parameter.normal_(0, 0.3)
        model.save_pretrained(root / f"adapter{index}")
        if index == 1:
            model.merge_and_unload().save_pretrained(root / "merged")
    return {name: str(root / name) for name in ("base", "adapter1", "adapter2", "merged")}


def reference_model(model_dirs, weights: str):
    """The transformers model that `weights` ("base", "merged", "adapter1", "adapter2") stands for."""
    if weights in ("base", "merged"):
        return AutoModelForCausalLM.from_pretrained(model_dirs[weights], local_files_only=True).eval()
    base = AutoModelForCausalLM.from_pretrained(model_dirs["base"], local_files_only=True)
    return peft.PeftModel.from_pretrained(base, f"{model_dirs[weights]}/policy").eval()


def max_logprob_gap(model, result) -> float:
    """Largest |engine - teacher-forced| logprob over every sampled token of `result`."""
    rows = [prompt for prompt in PROMPTS for _ in range(2)]
    gap = 0.0
    for prompt, tokens, engine_logprobs in zip(rows, result.token_ids, result.logprobs):
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([prompt + tokens])).logits[0].float()  # [L, V]
        logprobs = torch.log_softmax(logits[len(prompt) - 1:-1] / TEMPERATURE, dim=-1)  # [T, V]
        expected = logprobs.gather(-1, torch.tensor(tokens)[:, None]).squeeze(-1)  # [T]
        gap = max(gap, float((expected - torch.tensor(engine_logprobs)).abs().max()))
    return gap


def make_request(request_id: str, weights: WeightsSpec, seed: int = 0, top_p: float = 1.0) -> RolloutRequest:
    return RolloutRequest(request_id=request_id, weights=weights, prompt_token_ids=PROMPTS, n_samples_per_prompt=2,
                          max_new_tokens=24, temperature=TEMPERATURE, top_p=top_p, seed=seed, eos_token_id=EOS,
                          pad_token_id=0)


@pytest.fixture(scope="module")
def client(vllm_python, model_dirs, tmp_path_factory):
    root = tmp_path_factory.mktemp("vllm")
    with RolloutClient(root / "spool", "vllm", model_dirs["base"], root / "worker.log", python=vllm_python,
                       startup_timeout_s=300, engine_options={"max_lora_rank": 4, "gpu_memory_utilization": 0.1},
                       request_timeout_s=RolloutConfig.request_timeout_s,
                       heartbeat_timeout_s=RolloutConfig.heartbeat_timeout_s
                       ) as running:
        yield running


@pytest.mark.vllm
def test_base_logprobs_match_the_trainer_and_seeds_reproduce(client, model_dirs):
    base = WeightsSpec("base", None, 0)
    result = client.generate(make_request("base", base, seed=3))
    assert result.weights == base
    assert max_logprob_gap(reference_model(model_dirs, "base"), result) < MAX_GAP
    for tokens, reason in zip(result.token_ids, result.finish_reasons):
        assert 1 <= len(tokens) <= 24
        assert (reason == "stop") == (tokens[-1] == EOS)  # a stopped row ends in EOS, which is returned
    again = client.generate(make_request("base-again", base, seed=3))
    other = client.generate(make_request("base-other-seed", base, seed=4))
    assert again.token_ids == result.token_ids
    assert other.token_ids != result.token_ids


@pytest.mark.vllm
def test_checkpoint_sync_reloads_in_place_and_back(client, model_dirs):
    merged = WeightsSpec("checkpoint", model_dirs["merged"], 1)
    result = client.generate(make_request("checkpoint", merged, seed=5))
    assert result.weights == merged and client.served_weights == merged
    assert max_logprob_gap(reference_model(model_dirs, "merged"), result) < MAX_GAP
    # the same prompts again on the base: KV blocks cached under the checkpoint must not be reused
    base = client.generate(make_request("base-after-checkpoint", WeightsSpec("base", None, 2), seed=5))
    assert max_logprob_gap(reference_model(model_dirs, "base"), base) < MAX_GAP


@pytest.mark.vllm
def test_adapter_sync_serves_each_new_adapter(client, model_dirs):
    # after a checkpoint, an adapter must land on the base again, not on the checkpoint's weights
    client.generate(make_request("checkpoint-first", WeightsSpec("checkpoint", model_dirs["merged"], 3)))
    for version, name in ((4, "adapter1"), (5, "adapter2")):
        spec = WeightsSpec("adapter", model_dirs[name], version)
        result = client.generate(make_request(f"sync-{version}", spec, seed=7))
        assert result.weights == spec
        assert max_logprob_gap(reference_model(model_dirs, name), result) < MAX_GAP, name
    # and a skipped sync is visible: adapter2's samples scored by adapter1's weights do not match
    assert max_logprob_gap(reference_model(model_dirs, "adapter1"), result) > 1e-2


@pytest.mark.vllm
def test_top_p_below_one_is_refused_and_the_worker_survives(client):
    with pytest.raises(RolloutWorkerError, match=r"top_p=0.9: vLLM's sampling logprobs"):
        client.generate(make_request("top-p", WeightsSpec("base", None, 6), top_p=0.9))
    assert client.generate(make_request("after-top-p", WeightsSpec("base", None, 6))).weights.version == 6


@pytest.mark.vllm
def test_out_of_memory_at_start_names_the_key_and_the_log(vllm_python, model_dirs, tmp_path):
    # 0.1% of RAM cannot hold even the weights: vLLM finds no memory for its KV cache
    starving = RolloutClient(tmp_path / "spool", "vllm", model_dirs["base"], tmp_path / "worker.log",
                             python=vllm_python, startup_timeout_s=300, request_timeout_s=60,
                             heartbeat_timeout_s=RolloutConfig.heartbeat_timeout_s,
                             engine_options={"gpu_memory_utilization": 0.001})
    with pytest.raises(EngineStartError) as info:
        starving.start()
    message = str(info.value)
    assert "could not start: out of memory" in message and "gpu_memory_utilization=0.001" in message
    assert str(tmp_path / "worker.log") in message and "\n" not in message
    assert not starving.running


@pytest.mark.vllm
def test_gate_refuses_a_head_size_vllm_cannot_serve_on_cpu(vllm_python):
    with pytest.raises(GateError, match=r"attention head size 8 \(model.hidden_size=32") as info:
        check_rollout_engine("vllm", vllm_python, 8, "model.hidden_size=32 / model.num_attention_heads=4")
    assert "rollout=hf" in str(info.value)
    found = check_rollout_engine("vllm", vllm_python, 32, "")
    assert found["versions"]["vllm"] and 32 in found["attention_head_sizes"]


# --------------------------------------------------------------------------- no engine environment needed


def test_probe_of_an_interpreter_without_vllm_names_it():
    with pytest.raises(ValueError, match=r"cannot import \['vllm'\]: ModuleNotFoundError: No module named 'vllm'"):
        probe_engine_python(sys.executable, ("vllm",))


def test_gate_refuses_a_missing_or_vllm_less_engine_environment(tmp_path):
    missing = str(tmp_path / "no-venv" / "bin" / "python")
    with pytest.raises(GateError) as info:
        check_rollout_engine("vllm", missing, None)
    message = str(info.value)
    assert f"rollout.python={missing!r}" in message and "does not exist" in message
    assert "scripts/setup_vllm_env.sh" in message
    with pytest.raises(GateError, match=r"cannot import \['vllm'\].*scripts/setup_vllm_env.sh"):
        check_rollout_engine("vllm", sys.executable, None)


def test_worker_without_vllm_fails_to_start_with_the_cause(tmp_path):
    # the trainer's interpreter has no vllm: the worker must say so, not just exit 1
    client = RolloutClient(tmp_path / "spool", "vllm", str(tmp_path), tmp_path / "worker.log", startup_timeout_s=120,
                           request_timeout_s=60, heartbeat_timeout_s=RolloutConfig.heartbeat_timeout_s)
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(EngineStartError) as info:
        client.start()
    message = str(info.value)
    assert f"{sys.executable} cannot import what engine 'vllm' needs" in message and "No module named 'vllm'" in message
    assert "scripts/setup_vllm_env.sh" in message and str(tmp_path / "worker.log") in message
    assert not client.running
