"""PPO smoke runs with `rollout=vllm`: the engine runs in its own environment and must serve exactly
the weights each sync ships, which the ratio tripwire checks on every iteration's first minibatch.

They mirror the hf-engine runs in test_stages_smoke.py. The smoke model's heads are merged into one
(hidden size 32 -> head size 32) because vLLM's CPU attention has no kernel for head size 8.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from prmppo.app import run
from prmppo.guards import GateError

VLLM_SMOKE = ("stage=ppo", "rollout=vllm", "model.num_attention_heads=1", "model.num_key_value_heads=1",
              "rollout.gpu_memory_utilization=0.1")
# a large LR and an entropy bonus move the policy in one update, far enough that a stale engine shows
# (the smoke policy is never right, so entropy is what moves it)
MOVE_FAST = ("ppo.lr=0.05", "ppo.warmup_steps=0", "ppo.entropy_coef=1.0")


def _ppo_rows(run_dir: Path) -> list[dict]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [row for row in rows if row["stage"] == "ppo"]


@pytest.mark.vllm
@pytest.mark.parametrize("sync", ["checkpoint", "adapter"])
def test_vllm_ppo_engine_matches_trainer_after_each_sync(smoke_cfg, vllm_python, sync):
    # vLLM's LoRA carries the low-rank factors only: the adapter sync trains nothing else
    extra = ("lora.modules_to_save=[]",) if sync == "adapter" else ()
    cfg = smoke_cfg(*VLLM_SMOKE, f"rollout.python={vllm_python}", f"rollout.sync={sync}", *MOVE_FAST, *extra)
    summary = run(cfg)
    run_dir = Path(cfg.run_dir)
    rows = _ppo_rows(run_dir)
    assert [r["step"] for r in rows] == [0, 1]
    assert abs(rows[1]["ppo/kl_ref"]) > 1e-3, "the policy did not move: the check below would prove nothing"
    for row in rows:  # iteration 1 samples with the weights synced after iteration 0
        assert row["rollout/engine_logprob_abs_diff"] < 1e-4
        assert row["ppo/first_minibatch_ratio_dev"] < 1e-4
    assert summary["alarms"] == []
    banner = json.loads((run_dir / "banner.json").read_text())
    assert banner["rollout"] == {"engine": "vllm", "sync": sync, "sync_every_iterations": 1}
    engine_gate = banner["gates"]["rollout_engine"]
    assert engine_gate["python"] == vllm_python and engine_gate["head_dim"] == 32
    log = (run_dir / "worker.log").read_text()
    assert "starting vLLM" in log and f"kind='{sync}', path=" in log  # the worker served the synced weights


@pytest.mark.vllm
def test_vllm_skipped_sync_trips_the_ratio_tripwire(smoke_cfg, vllm_python):
    # sync every 2 iterations: iteration 1 samples with the base while the trainer has moved
    cfg = smoke_cfg(*VLLM_SMOKE, f"rollout.python={vllm_python}", "rollout.sync_every_iterations=2", *MOVE_FAST)
    summary = run(cfg)
    rows = _ppo_rows(Path(cfg.run_dir))
    assert rows[0]["rollout/engine_logprob_abs_diff"] < 1e-4
    assert rows[1]["rollout/engine_logprob_abs_diff"] > 1e-3
    alarms = [a for a in summary["alarms"] if a["tripwire"] == "ratio"]
    assert [a["iteration"] for a in alarms] == [1]
    assert alarms[0]["message"].startswith("rollout/engine_logprob_abs_diff=")


@pytest.mark.vllm
def test_vllm_with_an_unsupported_head_size_is_refused_before_sft(smoke_cfg, vllm_python):
    cfg = smoke_cfg("stage=ppo", "rollout=vllm", f"rollout.python={vllm_python}")  # smoke heads: 32 / 4 = 8
    head_size_8 = r"attention head size 8 \(model.hidden_size=32 / model.num_attention_heads=4\)"
    with pytest.raises(GateError, match=head_size_8):
        run(cfg)
    assert not list(Path(cfg.artifacts_dir).glob("sft-*"))


def test_vllm_without_its_environment_is_refused_before_sft(smoke_cfg, tmp_path):
    missing = tmp_path / "nowhere" / "bin" / "python"
    cfg = smoke_cfg(*VLLM_SMOKE, f"rollout.python={missing}")
    with pytest.raises(GateError, match=r"rollout.python=.* does not exist.*scripts/setup_vllm_env.sh"):
        run(cfg)
    assert not list(Path(cfg.artifacts_dir).glob("sft-*"))
    assert not (Path(cfg.run_dir) / "banner.json").exists()
