"""Tests of the worker process through the real subprocess and the client that drives it.

Each client start costs a Python + torch import in the child (a few seconds on CPU), so one
worker is shared by the tests that leave it healthy; the tests that kill or hang a worker start
their own.
"""

from __future__ import annotations

import math
import os
import signal
import threading
import time
from dataclasses import asdict

import pytest
import torch

# worker processes started, killed and hung on purpose; each pipeline smoke run also starts one
pytestmark = pytest.mark.slow

peft = pytest.importorskip("peft")
from transformers import AutoModelForCausalLM, MistralConfig, MistralForCausalLM  # noqa: E402

from prmppo.config.schema import RolloutConfig  # noqa: E402
from prmppo.rollout.client import RolloutClient  # noqa: E402
from prmppo.rollout.hf_engine import HFEngine  # noqa: E402
from prmppo.rollout.protocol import (  # noqa: E402
    EngineStartError,
    RolloutRequest,
    RolloutWorkerError,
    SpoolFileError,
    WeightsSpec,
    read_json,
    write_json_atomic,
)

BASE = WeightsSpec("base", None, 0)
PROMPTS = [[5, 6, 7], [8, 9, 10, 11]]


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    """A tiny base model dir and a LoRA adapter dir made on it (adapter saved as 'policy')."""
    root = tmp_path_factory.mktemp("models")
    torch.manual_seed(0)
    config = MistralConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=32, max_position_embeddings=128,
    )
    MistralForCausalLM(config).save_pretrained(root / "base")
    base = AutoModelForCausalLM.from_pretrained(root / "base", local_files_only=True)
    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    peft.get_peft_model(base, lora, adapter_name="policy").save_pretrained(root / "adapter")
    return str(root / "base"), str(root / "adapter")


def make_client(tmp_path, base_dir, **kwargs) -> RolloutClient:
    timeouts = {"startup_timeout_s": 60, "request_timeout_s": RolloutConfig.request_timeout_s,
                "heartbeat_timeout_s": RolloutConfig.heartbeat_timeout_s}
    return RolloutClient(tmp_path / "spool", "hf", base_dir, tmp_path / "worker.log", **{**timeouts, **kwargs})


def make_request(request_id: str, weights: WeightsSpec = BASE, seed: int = 0) -> RolloutRequest:
    return RolloutRequest(
        request_id=request_id, weights=weights, prompt_token_ids=PROMPTS, n_samples_per_prompt=2,
        max_new_tokens=5, temperature=1.0, top_p=1.0, seed=seed, eos_token_id=2, pad_token_id=0,
    )


@pytest.fixture(scope="module")
def client(model_dirs, tmp_path_factory):
    with make_client(tmp_path_factory.mktemp("shared"), model_dirs[0]) as running:
        yield running
    assert running.pid is None  # closed


def test_generate_round_trip_matches_in_process_engine(client, model_dirs):
    result = client.generate(make_request("round-trip", seed=11))
    assert result.request_id == "round-trip"
    assert len(result.token_ids) == len(PROMPTS) * 2
    assert all(math.isfinite(lp) for row in result.logprobs for lp in row)
    assert client.served_weights == BASE
    expected = HFEngine(model_dirs[0]).generate(PROMPTS, 2, 5, 1.0, 1.0, 11, 2, 0)
    assert (result.token_ids, result.finish_reasons) == (expected[0], expected[2])
    beat = read_json(client.spool.heartbeat, "heartbeat")
    assert beat["status"] == "ready" and beat["pid"] == client.pid


def test_adapter_sync_is_reported_as_served(client, model_dirs):
    base_tokens = client.generate(make_request("before-sync", seed=5)).token_ids
    spec = WeightsSpec("adapter", model_dirs[1], 1)
    result = client.generate(make_request("after-sync", weights=spec, seed=5))
    assert result.weights == spec and client.served_weights == spec
    assert result.token_ids != base_tokens
    # the heartbeat thread rewrites its file every second: give it a few beats to catch up
    deadline = time.time() + 10
    while read_json(client.spool.heartbeat, "heartbeat")["weights"] != asdict(spec) and time.time() < deadline:
        time.sleep(0.1)
    assert read_json(client.spool.heartbeat, "heartbeat")["weights"] == asdict(spec)


def test_worker_error_is_raised_and_worker_survives(client, tmp_path):
    bad = WeightsSpec("adapter", str(tmp_path), 2)  # no adapter_config.json there
    with pytest.raises(RolloutWorkerError, match="adapter_config.json"):
        client.generate(make_request("bad-weights", weights=bad))
    assert client.generate(make_request("after-error")).weights == BASE


def test_second_client_on_a_live_spool_is_refused(client, model_dirs, tmp_path):
    intruder = RolloutClient(client.spool.root, "hf", model_dirs[0], tmp_path / "other.log", startup_timeout_s=60,
                             request_timeout_s=60, heartbeat_timeout_s=RolloutConfig.heartbeat_timeout_s)
    with pytest.raises(RolloutWorkerError, match="in use by a live worker"):
        intruder.start()
    assert intruder.pid is None and client.running


def test_corrupt_result_raises_spool_file_error(client):
    os.kill(client.pid, signal.SIGSTOP)  # the worker must not answer before the corrupt file lands
    result_path = client.spool.result("corrupt")

    def write_corrupt_result():
        deadline = time.monotonic() + 10
        while not client.spool.request("corrupt").exists() and time.monotonic() < deadline:
            time.sleep(0.005)
        write_json_atomic(result_path.with_name("tmp.json"), {"request_id": "corrupt"})
        truncated = result_path.with_name("tmp.json").read_text()[:-9]
        result_path.with_name("tmp.json").unlink()
        result_path.write_text(truncated)

    writer = threading.Thread(target=write_corrupt_result)
    writer.start()
    try:
        with pytest.raises(SpoolFileError) as info:
            client.generate(make_request("corrupt"))
    finally:
        writer.join()
        os.kill(client.pid, signal.SIGCONT)
    assert str(result_path) in str(info.value) and "not valid JSON" in str(info.value)


def test_killed_worker_raises_quickly_with_log_path(model_dirs, tmp_path):
    with make_client(tmp_path, model_dirs[0]) as victim:
        # the worker logs its ready line around its first heartbeat, which is what entering waits for: under
        # load the line can land after it, and a kill before it would leave it out of the log tail
        deadline = time.monotonic() + 30
        while "ready: serving" not in (tmp_path / "worker.log").read_text() and time.monotonic() < deadline:
            time.sleep(0.05)
        os.kill(victim.pid, signal.SIGSTOP)  # hold it so the request is surely in flight
        threading.Timer(0.3, os.kill, (victim.pid, signal.SIGKILL)).start()
        start = time.monotonic()
        with pytest.raises(RolloutWorkerError) as info:
            victim.generate(make_request("doomed"))
        assert time.monotonic() - start < 5
    message = str(info.value)
    assert str(tmp_path / "worker.log") in message and "exited with code -9" in message
    assert "ready: serving" in message  # the log tail is included


def test_hung_worker_is_detected_by_stale_heartbeat(model_dirs, tmp_path):
    with make_client(tmp_path, model_dirs[0], heartbeat_timeout_s=1.0) as frozen:
        pid = frozen.pid
        os.kill(pid, signal.SIGSTOP)
        start = time.monotonic()
        with pytest.raises(RolloutWorkerError, match="hung: heartbeat"):
            frozen.generate(make_request("frozen"))
        assert time.monotonic() - start < 5
        assert not frozen.running  # the hung worker was killed, not leaked


def test_start_fails_fast_when_the_engine_cannot_load(tmp_path):
    client = make_client(tmp_path, str(tmp_path / "no-such-model"))
    with pytest.raises(EngineStartError) as info:
        client.start()
    message = str(info.value)  # the cause the worker reported, in one line with the log path
    assert "rollout engine 'hf' could not start: FileNotFoundError:" in message and "has no config.json" in message
    assert str(tmp_path / "worker.log") in message and "\n" not in message
    assert not client.running


def test_launch_returns_before_the_worker_is_ready_and_entering_waits_for_it(model_dirs, tmp_path):
    client = make_client(tmp_path, model_dirs[0])
    start = time.monotonic()
    client.launch()
    launched_in = time.monotonic() - start
    pid = client.pid
    assert client.running and not client.spool.heartbeat.exists()  # the child is still importing torch
    with client as ready:  # waits for the launched worker; starts no second one
        assert ready.pid == pid and read_json(ready.spool.heartbeat, "heartbeat")["status"] == "ready"
        assert time.monotonic() - start > launched_in
        assert ready.generate(make_request("after-launch")).weights == BASE
    assert client.pid is None


def test_wait_ready_without_launch_is_refused(model_dirs, tmp_path):
    with pytest.raises(RolloutWorkerError, match="call launch"):
        make_client(tmp_path, model_dirs[0]).wait_ready()
