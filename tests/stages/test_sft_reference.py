"""`sft.steps=0` on a given model directory accepts it as it is, copying none of its weights:

    python -m prmppo stage=sft model=hf model.path=<dir> sft.steps=0
    python -m prmppo stage=ppo model=hf model.path=<dir> sft.steps=0      # reuses that SFT artifact
    python -m prmppo stage=eval model=hf model.path=<dir> sft.steps=0

The SFT artifact holds its manifest and a reference to the directory (`models/loading.py MODEL_REFERENCE`);
PPO (trainer, tokenizer, rollout worker) and eval load the weights from the directory itself, and a
directory changed after the artifact was made is refused by name before any weights load.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import compose_config
from prmppo.app import run
from prmppo.config.build import build
from prmppo.models.loading import MODEL_REFERENCE, ModelDirError
from prmppo.stages.sft_training import ensure_sft


def _given_dir(tmp_path: Path) -> Path:
    """A tiny model saved in the HF layout by the smoke config's own model source: the user's directory."""
    cfg = compose_config(["debug=smoke"])
    return build(cfg.model, "model source").materialize(build(cfg.task, "task"), tmp_path / "given")


def _accept_as_is(smoke_cfg, model_dir: Path, *overrides: str):
    return smoke_cfg("model=hf", f"model.path={model_dir}", "model.dtype=float32", "sft.steps=0",
                     "sft.eval_problems=2", *overrides)


def test_sft_steps_0_on_a_model_dir_refers_to_it_and_still_evaluates(smoke_cfg, tmp_path):
    given = _given_dir(tmp_path)
    cfg = _accept_as_is(smoke_cfg, given, "stage=sft")
    summary = run(cfg)

    artifact = Path(summary["checkpoint"])
    assert sorted(p.name for p in artifact.iterdir()) == ["artifact.json", MODEL_REFERENCE]  # no weights copied
    assert json.loads((artifact / MODEL_REFERENCE).read_text())["path"] == str(given.resolve())
    assert summary["weights"] == str(given.resolve())
    result = json.loads((Path(cfg.run_dir) / "stage_result.json").read_text())  # the end-of-SFT evaluation ran
    assert result["status"] == "ok" and result["stage"] == "sft"
    assert result["summary"]["test"]["n_problems"] == result["summary"]["sft_distribution"]["n_problems"] == 2

    # later stages get the directory with the weights, checked unchanged
    task = build(cfg.task, "task")
    weights_dir, reused = ensure_sft(cfg, task, Path(cfg.run_dir), reuse=True)
    assert weights_dir == given.resolve() and reused["reused"] is True

    (given / "config.json").write_text((given / "config.json").read_text() + "\n")  # edited after the artifact
    with pytest.raises(ModelDirError, match=r"config.json was \d+ bytes, now \d+"):
        ensure_sft(cfg, task, Path(cfg.run_dir), reuse=True)


@pytest.mark.slow  # an SFT evaluation, 2 PPO iterations through the rollout worker and an eval: ~1 min on 2 cores
def test_ppo_and_eval_run_from_an_sft_artifact_that_refers_to_the_model_dir(smoke_cfg, tmp_path):
    given = _given_dir(tmp_path)
    run(_accept_as_is(smoke_cfg, given, "stage=sft"))
    (artifact,) = (tmp_path / "artifacts").glob("sft-*")

    ppo_cfg = _accept_as_is(smoke_cfg, given, "stage=ppo", "arm=orm")
    summary = run(ppo_cfg)
    assert summary["policy_steps"] == summary["planned_policy_steps"] > 0
    rows = [json.loads(line) for line in (Path(ppo_cfg.run_dir) / "metrics.jsonl").read_text().splitlines()]
    ppo_rows = [row for row in rows if row["stage"] == "ppo"]
    assert [row["step"] for row in ppo_rows] == [0, 1]
    # the worker served the policy the trainer holds: it loaded the same base weights, from the given directory
    assert all(row["rollout/engine_logprob_abs_diff"] < 1e-4 for row in ppo_rows)
    assert sorted(p.name for p in artifact.iterdir()) == ["artifact.json", MODEL_REFERENCE]  # reused, not re-made

    evaluation = run(_accept_as_is(smoke_cfg, given, "stage=eval", "arm=orm"))  # this config's SFT and PPO artifacts
    assert evaluation["sft"]["checkpoint"] == str(artifact) and evaluation["sft"]["n_problems"] == 8
    assert {"sft", "ppo"} <= set(evaluation)
