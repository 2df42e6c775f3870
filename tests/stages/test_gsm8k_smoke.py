"""GSM8K through every stage on the tiny model with a byte-level BPE tokenizer, as a user types it:

    python -m prmppo debug=smoke task=gsm8k task.data_dir=<data> prm_train.label_source=monte_carlo

`debug=smoke` picks `model.tokenizer=auto`, which trains a 1024-token BPE on GSM8K's SFT texts (their
character count does not fit the context). The default `prm_train.label_source=checker` is refused
before any weights, since GSM8K has no exact step checker. Needs the GSM8K files: $PRMPPO_DATA_DIR/gsm8k,
else ../shared/data/gsm8k beside the repository (as `conf/task/gsm8k.yaml` finds them).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from conftest import REPO, compose_config, run_prmppo
from prmppo.config.build import build
from prmppo.models.loading import load_tokenizer

DATA_DIR = Path(os.environ.get("PRMPPO_DATA_DIR", REPO.parent / "shared" / "data")) / "gsm8k"
# slow: every stage on GSM8K with a BPE tokenizer trained first, each run a subprocess
pytestmark = [pytest.mark.slow, pytest.mark.skipif(
    not (DATA_DIR / "train.jsonl").is_file() or not (DATA_DIR / "test.jsonl").is_file(),
    reason=f"no GSM8K train.jsonl/test.jsonl at {DATA_DIR} (set PRMPPO_DATA_DIR to the folder holding gsm8k/)")]

SMOKE_GSM8K = ["debug=smoke", "task=gsm8k", f"task.data_dir={DATA_DIR}"]


def _rows(run_dir: Path, stage: str) -> list[dict]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [row for row in rows if row["stage"] == stage]


def test_gsm8k_runs_sft_prm_ppo_and_eval_on_a_bpe_tiny_model(tmp_path):
    run_dir, artifacts_dir = tmp_path / "run", tmp_path / "artifacts"
    proc = run_prmppo([*SMOKE_GSM8K, "prm_train.label_source=monte_carlo", f"artifacts_dir={artifacts_dir}",
                       f"hydra.run.dir={run_dir}"], cwd=tmp_path, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads((run_dir / "stage_result.json").read_text())
    assert result["status"] == "ok" and result["stage"] == "pipeline"

    # the model: a tiny Mistral with a 1024-token byte-level BPE trained on GSM8K's SFT texts
    made = json.loads((run_dir / "init_model" / "prmppo_model.json").read_text())
    assert made["tokenizer"] == "bpe" and made["bpe_vocab_size"] == 1024
    (sft_dir,) = artifacts_dir.glob("sft-*")
    spec = json.loads((sft_dir / "tokenizer.json").read_text())
    assert spec["model"]["type"] == "BPE" and spec["pre_tokenizer"]["type"] == "ByteLevel"
    assert len(spec["model"]["merges"]) == 1024 - 4 - 256
    tokenizer = load_tokenizer(sft_dir)
    cfg = compose_config([*SMOKE_GSM8K])
    task = build(cfg.task, "task")
    for problem in task.problems("test")[: cfg.task.test_size]:
        text = task.format_prompt(problem) + problem.solution
        ids = tokenizer(text)["input_ids"]
        assert tokenizer.decode(ids, skip_special_tokens=True) == text  # exact, even "$", "," and "\u2019"
        assert len(ids) < len(text) / 2  # GSM8K is made of words: far fewer tokens than characters

    # 1. SFT trained (its loss fell) on every train row; 2. the PRM on Monte-Carlo labels
    sft = _rows(run_dir, "sft")
    assert sft[-2]["sft/loss"] < sft[0]["sft/loss"] and sft[-1]["eval/test_greedy_accuracy"] >= 0
    (prm_dir,) = artifacts_dir.glob("prm-*")
    prm = json.loads((prm_dir / "artifact.json").read_text())
    assert prm["config"]["prm_train"]["label_source"] == "monte_carlo"
    # one example per policy sample: 6 train problems x 2 samples
    assert prm["summary"]["labels"]["examples"] == cfg.prm_train.train_problems * cfg.prm_train.samples_per_problem
    assert prm["summary"]["labels"]["labelled_steps"] >= prm["summary"]["labels"]["examples"]
    assert [r["step"] for r in _rows(run_dir, "prm") if "prm/loss" in r][-1] == cfg.prm_train.steps - 1

    # 3. PPO with the learned PRM's step rewards, engine in step with the trainer
    banner = json.loads((run_dir / "banner.json").read_text())
    assert banner["gates"]["prm_labels"] == {"prm_labels": "monte_carlo"}
    assert banner["gates"]["step_scorer"] == {"step_scores": "learned PRM"}
    ppo = _rows(run_dir, "ppo")
    assert [r["step"] for r in ppo] == [0, 1]
    assert all("reward/prm_mean" in r and r["rollout/engine_logprob_abs_diff"] < 1e-4 for r in ppo)

    # 4. eval of both policies on the same test problems
    evaluation = json.loads((run_dir / "eval.json").read_text())
    assert evaluation["sft"]["checkpoint"] == str(sft_dir)
    for name in ("sft", "ppo"):
        assert evaluation[name]["n_problems"] == cfg.eval.n_problems
        assert 0 <= evaluation[name]["greedy_accuracy"] <= 1 and 0 <= evaluation[name]["pass@2"] <= 1
    (ppo_dir,) = artifacts_dir.glob("ppo-*")
    assert json.loads((ppo_dir / "config.json").read_text())["vocab_size"] == 1024


def test_gsm8k_with_the_default_checker_labels_is_refused_in_seconds(tmp_path):
    artifacts_dir = tmp_path / "artifacts"
    proc = run_prmppo([*SMOKE_GSM8K, f"artifacts_dir={artifacts_dir}", f"hydra.run.dir={tmp_path / 'run'}"],
                      cwd=tmp_path, timeout=120)
    assert proc.returncode == 2, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("prmppo: refused: prm_train.label_source=checker needs an exact step checker")
    assert "prm_train.label_source=monte_carlo" in last and "arm=orm" in last and "Traceback" not in proc.stderr
    assert not artifacts_dir.exists() and not (tmp_path / "run" / "init_model").exists()  # no SFT ran
