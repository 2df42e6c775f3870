"""CPU smoke runs of the real stages on the real (shrunk) config, through the real worker process."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from prmppo.app import run
from prmppo.models.loading import load_model, load_tokenizer


def _metrics(run_dir: Path, stage: str) -> list[dict]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [row for row in rows if row["stage"] == stage]


def test_sft_smoke_trains_saves_and_reports(smoke_cfg):
    cfg = smoke_cfg("stage=sft")
    summary = run(cfg)
    run_dir = Path(cfg.run_dir)
    losses = [row["sft/loss"] for row in _metrics(run_dir, "sft") if "sft/loss" in row]
    assert losses[-1] < losses[0]  # 20 steps from random init must lower the loss
    checkpoint = Path(summary["checkpoint"])
    assert (checkpoint / "artifact.json").exists()
    load_model(checkpoint), load_tokenizer(checkpoint)  # loads through the common path
    result = json.loads((run_dir / "stage_result.json").read_text())
    assert result["stage"] == "sft" and 0.0 <= result["summary"]["test"]["greedy_accuracy"] <= 1.0


# the default sync in the fast tier; the other two, each another SFT and PPO run, in the slow one
@pytest.mark.parametrize("sync", ["checkpoint", pytest.param("adapter", marks=pytest.mark.slow),
                                  pytest.param("shared", marks=pytest.mark.slow)])
def test_ppo_smoke_engine_matches_trainer_after_sync(smoke_cfg, sync):
    # a large LR and an entropy bonus move the policy in one update, far enough that a stale
    # engine would show
    cfg = smoke_cfg("stage=ppo", f"rollout.sync={sync}", "ppo.lr=0.05", "ppo.warmup_steps=0",
                    "ppo.entropy_coef=1.0")  # the smoke policy is never right: entropy moves it
    summary = run(cfg)
    run_dir = Path(cfg.run_dir)
    rows = _metrics(run_dir, "ppo")
    assert [r["step"] for r in rows] == [0, 1]
    moved = rows[1]["ppo/kl_ref"]
    assert abs(moved) > 1e-3, "the policy did not move: the check below would prove nothing"
    for row in rows:
        assert row["rollout/engine_logprob_abs_diff"] < 1e-4  # engine served exactly the synced policy
        assert row["ppo/first_minibatch_ratio_dev"] < 1e-4  # policy unchanged on the first minibatch
    banner = json.loads((run_dir / "banner.json").read_text())
    assert banner["rollout"]["sync"] == sync and banner["derived_ids"]["eos_token_id"] == 2
    gates = banner["gates"]  # what each launch gate derived
    assert gates["verifier_receipt"]["gold_pass_rate"] == 1.0 and gates["verifier_receipt"]["corrupted_pass_rate"] == 0
    assert gates["topology"]["train_gpus"] == [] and gates["eos"]["eos_token_id"] == 2
    assert gates["ratio_tripwire"]["self_test"] == "fired" and gates["horizon"]["policy_optimizer_steps"] == 4
    # fp32: the launch measurement of the engine-vs-trainer gap is ~1e-7, so the configured limit stands
    assert gates["ratio_tripwire"]["measured_at_identical_weights"] < 1e-4
    assert gates["ratio_tripwire"]["limit"] == gates["ratio_tripwire"]["max_logprob_gap"] == 1e-2
    assert gates["reference"]["max_abs_logprob_diff"] <= gates["reference"]["tolerance"]
    startup = banner["startup_s"]  # where the launch's seconds went
    laps = {"task", "early_gates", "inputs", "tokenizer", "policy", "reward", "reference_gate", "worker_ready",
            "trainer", "resume", "engine_gap_gate"}
    assert set(startup) == laps | {"before_first_lap", "total"}
    assert all(seconds >= 0 for seconds in startup.values())
    assert startup["total"] >= startup["before_first_lap"] + sum(startup[lap] for lap in laps) - 0.01
    assert summary["alarms"] == []  # on-policy: no tripwire fires
    # 2 iterations x (4 prompts x 2 samples / 4 rows per minibatch) = 4 policy optimizer steps
    assert summary["policy_steps"] == summary["planned_policy_steps"] == 4
    assert (Path(summary["checkpoint"]) / "config.json").exists()


# the in-process engine samples with the trainer's own model: under arm=prm the learned PRM's adapter joins that
# model beside the policy's; under lora=none the engine samples with the very object the update trains
@pytest.mark.parametrize("overrides", [["arm=orm"], ["arm=prm"],
                                       pytest.param(["arm=orm", "lora=none"], marks=pytest.mark.slow)],
                         ids=["orm", "prm", "orm-full"])
def test_ppo_smoke_with_the_in_process_engine(smoke_cfg, overrides):
    cfg = smoke_cfg("stage=ppo", "rollout=inprocess", *overrides, "ppo.lr=0.05", "ppo.warmup_steps=0",
                    "ppo.entropy_coef=1.0")  # moves the policy in one update, as above
    summary = run(cfg)
    run_dir = Path(cfg.run_dir)
    rows = _metrics(run_dir, "ppo")
    assert [r["step"] for r in rows] == [0, 1]
    assert abs(rows[1]["ppo/kl_ref"]) > 1e-3, "the policy did not move: the check below would prove nothing"
    for row in rows:
        assert row["rollout/engine_logprob_abs_diff"] < 1e-4  # sampled with the weights the trainer scores
        assert row["ppo/first_minibatch_ratio_dev"] < 1e-4
    banner = json.loads((run_dir / "banner.json").read_text())
    assert banner["rollout"] == {"engine": "inprocess", "sync": "none", "sync_every_iterations": 1}
    gate = banner["gates"]["ratio_tripwire"]  # the engine-gap gate at launch
    assert gate["self_test"] == "fired" and gate["measured_at_identical_weights"] < 1e-4 and gate["limit"] == 1e-2
    assert summary["alarms"] == [] and summary["policy_steps"] == summary["planned_policy_steps"] == 4
    # no worker was started and nothing was shipped to one
    assert not (run_dir / "worker.log").exists() and not (run_dir / "spool").exists()
    assert not any((run_dir / "sync").iterdir())


def test_skipped_sync_shows_as_an_engine_gap(smoke_cfg):
    # sync every 2 iterations: iteration 1 samples with the base while the trainer has moved
    cfg = smoke_cfg("stage=ppo", "rollout.sync_every_iterations=2", "ppo.lr=0.05", "ppo.warmup_steps=0",
                    "ppo.entropy_coef=1.0", "canary.every=1", "canary.n_problems=4")
    run(cfg)  # the smoke policy is never right: entropy moves it
    rows = _metrics(Path(cfg.run_dir), "ppo")
    assert rows[0]["rollout/engine_logprob_abs_diff"] < 1e-4
    assert rows[1]["rollout/engine_logprob_abs_diff"] > 1e-3
    # the ratio tripwire turns the gap into an alarm in stage_result.json, for iteration 1 only
    alarms = json.loads((Path(cfg.run_dir) / "stage_result.json").read_text())["summary"]["alarms"]
    alarms = [a for a in alarms if a["tripwire"] == "ratio"]
    assert [a["iteration"] for a in alarms] == [1]
    assert alarms[0]["message"].startswith("rollout/engine_logprob_abs_diff=")
    assert "ppo.max_engine_logprob_gap=0.01" in alarms[0]["message"]
    canary = [json.loads(line) for line in (Path(cfg.run_dir) / "canary.jsonl").read_text().splitlines()]
    assert [row["iteration"] for row in canary] == [0, 1] and 0 <= canary[0]["greedy_accuracy"] <= 1


def test_pipeline_smoke_writes_eval_of_both_policies(smoke_cfg):
    cfg = smoke_cfg()
    summary = run(cfg)
    run_dir = Path(cfg.run_dir)
    evaluation = json.loads((run_dir / "eval.json").read_text())
    assert set(evaluation) == {"sft", "ppo", "delta"}
    for name in ("sft", "ppo"):
        assert {"greedy_accuracy", "sampled_accuracy", "pass@2"} <= set(evaluation[name])
    assert summary["sft"]["checkpoint"] == evaluation["sft"]["checkpoint"]
    # a second pipeline run with the same config reuses the SFT checkpoint
    again = run(smoke_cfg())
    assert again["sft"]["reused"] is True


SCORER_OF = {"prm": "learned", "prm_oracle": "oracle", "prm_likelihood_control": "likelihood_control"}


@pytest.mark.parametrize("reward, estimator", [("prm", "gae"), pytest.param("prm_oracle", "gae", marks=pytest.mark.slow),
                                               ("prm_oracle", "rloo"), ("prm_likelihood_control", "gae")])
def test_prm_arm_smoke_runs_ppo_with_step_rewards(smoke_cfg, reward, estimator):
    cfg = smoke_cfg("stage=ppo", "arm=prm", f"reward={reward}", f"ppo.advantage_estimator={estimator}")
    summary = run(cfg)
    rows = _metrics(Path(cfg.run_dir), "ppo")
    assert [r["step"] for r in rows] == [0, 1]
    for row in rows:
        assert "hack/steps_per_response" in row and "reward/prm_mean" in row
        assert row["rollout/engine_logprob_abs_diff"] < 1e-4
    banner = json.loads((Path(cfg.run_dir) / "banner.json").read_text())
    assert banner["arm"] == "prm" and banner["reward"]["scorer"] == SCORER_OF[reward]
    assert summary["policy_steps"] == summary["planned_policy_steps"]
    # only the learned PRM needs a PRM stage: the oracle and the likelihood control run without one
    assert bool(list(Path(cfg.artifacts_dir).glob("prm-*"))) == (reward == "prm")


def test_ppo_gate_refusal_stops_the_run_before_the_banner(smoke_cfg):
    # the topology gate runs right after the task is built, before SFT or any weights: nothing is made
    cfg = smoke_cfg("stage=ppo", "topology.engine_device=cuda:0")
    from prmppo.guards import GateError

    with pytest.raises(GateError, match=r"topology.engine_device='cuda:0' but no CUDA device is visible"):
        run(cfg)
    assert not (Path(cfg.run_dir) / "banner.json").exists()
    assert not list(Path(cfg.artifacts_dir).glob("sft-*"))
