"""The standby rollout worker (`rollout/standby.py`): started before the trainer's imports, adopted
by `RolloutClient.launch`, and gone when nobody takes it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
import torch
from transformers import MistralConfig, MistralForCausalLM

from conftest import compose_config
from prmppo.models.tiny import TinyModelSource
from prmppo.rollout import standby
from prmppo.rollout.client import RolloutClient
from prmppo.rollout.protocol import RolloutRequest, WeightsSpec, read_json

BASE = WeightsSpec("base", None, 0)


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("standby-model")
    torch.manual_seed(0)
    MistralForCausalLM(MistralConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                     num_key_value_heads=2, vocab_size=32, max_position_embeddings=64)
                       ).save_pretrained(root)
    return str(root)


def _client(tmp_path, base_dir) -> RolloutClient:
    return RolloutClient(tmp_path / "spool", "hf", base_dir, tmp_path / "worker.log", startup_timeout_s=60,
                         request_timeout_s=60, heartbeat_timeout_s=30)


def _wait_exit(proc: subprocess.Popen, seconds: float = 60) -> int | None:
    deadline = time.monotonic() + seconds
    while proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    return proc.poll()


def test_the_client_adopts_the_standby_and_it_serves(tmp_path, base_dir):
    waiting = standby.start(sys.executable, "hf", None, "mistral")
    assert waiting is not None and waiting.poll() is None
    client = _client(tmp_path, base_dir)
    with client:
        assert client.pid == waiting.pid  # no second process
        assert read_json(client.spool.heartbeat, "heartbeat")["pid"] == waiting.pid
        result = client.generate(RolloutRequest(request_id="r", weights=BASE, prompt_token_ids=[[5, 6, 7]],
                                                n_samples_per_prompt=2, max_new_tokens=4, temperature=1.0, top_p=1.0,
                                                seed=0, eos_token_id=2, pad_token_id=0))
        assert len(result.token_ids) == 2
    assert _wait_exit(waiting) == 0  # the shutdown request, as for a worker the client started
    log = (tmp_path / "worker.log").read_text()
    assert f"rollout-worker[{waiting.pid}] starting engine 'hf'" in log  # its output went to the run's log
    assert standby.take(sys.executable, "hf") is None  # taken once


def test_a_standby_that_died_is_replaced_by_a_fresh_worker(tmp_path, base_dir):
    waiting = standby.start(sys.executable, "hf", None)
    waiting.kill()
    waiting.wait()
    with _client(tmp_path, base_dir) as client:
        assert client.pid != waiting.pid and client.running


def test_a_client_with_its_own_environment_starts_its_own_worker(tmp_path, base_dir):
    waiting = standby.start(sys.executable, "hf", None)
    client = RolloutClient(tmp_path / "spool", "hf", base_dir, tmp_path / "worker.log", startup_timeout_s=60,
                           request_timeout_s=60, heartbeat_timeout_s=30, env=dict(os.environ))
    with client:
        assert client.pid != waiting.pid
    assert standby.take(sys.executable, "hf") is waiting  # still waiting for a client it fits
    waiting.stdin.close()
    assert _wait_exit(waiting) == 0


def test_a_standby_nobody_takes_exits_when_its_stdin_closes():
    proc = subprocess.Popen([sys.executable, "-m", "prmppo.rollout.worker", "--standby", "hf"],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    proc.stdin.close()
    assert _wait_exit(proc) == 0
    assert proc.stdout.read() == b""


def test_a_standby_nobody_takes_is_killed_when_the_trainer_exits(tmp_path):
    script = ("import sys; from prmppo.rollout import standby; "
              "p = standby.start(sys.executable, 'hf', None); print(p.pid, flush=True)")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    pid = int(done.stdout.split()[0])
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as stat:
                if stat.read().split()[2] == "Z":  # a zombie of the exited trainer: dead
                    break
        except FileNotFoundError:
            break
        time.sleep(0.05)
    else:
        pytest.fail(f"standby pid {pid} outlived its trainer")


def test_only_a_ppo_run_on_one_process_with_the_built_in_engine_gets_one(monkeypatch):
    started = []
    monkeypatch.setattr(standby, "start", lambda *args: started.append(args) or "proc")
    assert standby.start_for(compose_config(["debug=smoke", "stage=ppo"])) == "proc"
    python, engine, env, model_type = started[0]
    assert (python, engine, model_type) == (sys.executable, "hf", "mistral")
    assert "TOKENIZERS_PARALLELISM" in env and "PYTORCH_CUDA_ALLOC_CONF" in env  # as app.run sets them
    started.clear()
    for stage in ("pipeline", "sft", "prm"):  # their PPO, if any, comes minutes later
        assert standby.start_for(compose_config(["debug=smoke", f"stage={stage}"])) is None
    assert not started
    assert standby.start_for(compose_config(["debug=smoke", "stage=ppo", "rollout.standby=false"])) is None
    assert not started
    monkeypatch.setenv("WORLD_SIZE", "2")
    started.clear()
    assert standby.start_for(compose_config(["debug=smoke", "stage=ppo"])) is None and not started


def test_start_returns_none_for_vllm_and_for_a_missing_interpreter(tmp_path):
    assert standby.start(sys.executable, "vllm", None) is None
    assert standby.start(str(tmp_path / "no-python"), "hf", None) is None


def test_the_model_type_is_read_without_transformers(tmp_path):
    cfg = compose_config(["debug=smoke"])
    tiny = TinyModelSource(**{k: v for k, v in cfg.model.items() if k != "_target_"})
    assert standby.model_type(cfg.model) == standby.TINY_MODEL_TYPE == tiny.architecture()[0]["model_type"]
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
    assert standby.model_type(compose_config(["model=hf", f"model.path={tmp_path}"]).model) == "qwen2"
    assert standby.model_type(compose_config(["model=hf", f"model.path={tmp_path / 'none'}"]).model) == ""
    assert standby.model_type(compose_config(["model=hf"]).model) == ""  # model.path not given yet (`???`)
    other = compose_config(["model=hf", f"model.path={tmp_path}"]).model
    other._target_ = "prmppo.models.loading.SomeOtherSource"  # a source with no known layout: nothing read
    assert standby.model_type(other) == ""


def test_the_entry_point_imports_no_torch_before_the_config_is_composed():
    script = ("import sys, prmppo.__main__, prmppo.sweep; "
              "print([m for m in ('torch', 'transformers', 'peft', 'prmppo.app') if m in sys.modules])")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=True)
    assert done.stdout.strip() == "[]"


@pytest.mark.slow  # SFT and PPO in a subprocess
def test_python_m_prmppo_stage_ppo_runs_its_worker_in_the_standby(tmp_path):
    from conftest import run_prmppo

    run_dir = tmp_path / "run"
    proc = run_prmppo(["stage=ppo", "debug=smoke", "ppo.iterations=1", f"artifacts_dir={tmp_path / 'artifacts'}",
                       f"hydra.run.dir={run_dir}"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    main_log = (run_dir / "__main__.log").read_text()
    adopted = [line for line in main_log.splitlines() if "the standby started with the run" in line]
    assert len(adopted) == 1
    pid = adopted[0].split("(pid ")[1].split(")")[0]
    assert f"rollout-worker[{pid}] ready: serving" in (run_dir / "worker.log").read_text()
