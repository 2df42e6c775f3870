"""`task=jsonl` through SFT, PPO and eval under both arms, as a user types it, on a tiny model whose tokenizer
carries a chat template (prompts rendered through it):

    python -m prmppo debug=smoke task=jsonl task.train_path=<verl_train.jsonl> task.test_path=<verl_test.parquet> \\
        model=hf model.path=<tiny chat model> model.dtype=float32 model.chat_template=true \\
        prm_train.label_source=monte_carlo arm=orm      # then arm=prm

The two runs share one artifacts dir: the PRM arm reuses the SFT checkpoint the ORM arm trained.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import compose_config, run_prmppo
from prmppo.config.build import build
from prmppo.models.loading import load_tokenizer

from chat_models import TEST, TRAIN, make_chat_model


def _rows(run_dir: Path, stage: str) -> list[dict]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [row for row in rows if row["stage"] == stage]


@pytest.mark.slow  # two pipelines: 3-8 minutes on a 2-core CPU
def test_jsonl_task_with_a_chat_template_runs_sft_ppo_and_eval_under_both_arms(tmp_path):
    model_dir = make_chat_model(tmp_path / "chat_model")
    smoke = ["debug=smoke", "task=jsonl", f"task.train_path={TRAIN}", f"task.test_path={TEST}", "model=hf",
             f"model.path={model_dir}", "model.dtype=float32", "model.chat_template=true",
             "prm_train.label_source=monte_carlo"]

    # the rendered prompt of one row, as every stage sees it
    task = build(compose_config(smoke).task, "task")
    problem = task.problems("train")[1]
    rendered = task.format_prompt(problem)
    print(rendered)
    assert rendered == "<|user|>\nCompute 9 - 2, then halve it. Put the final answer in \\boxed{}.\n<|assistant|>\n"

    artifacts_dir = tmp_path / "artifacts"
    for arm in ("orm", "prm"):
        run_dir = tmp_path / f"run-{arm}"
        proc = run_prmppo([*smoke, f"arm={arm}", f"artifacts_dir={artifacts_dir}", f"hydra.run.dir={run_dir}"],
                          cwd=tmp_path, timeout=900)
        assert proc.returncode == 0, proc.stderr[-3000:]
        result = json.loads((run_dir / "stage_result.json").read_text())
        assert result["status"] == "ok" and result["stage"] == "pipeline" and result["arm"] == arm
        banner = json.loads((run_dir / "banner.json").read_text())
        receipt = banner["gates"]["verifier_receipt"]  # math-verify on the fixture's LaTeX answers
        assert receipt["gold_pass_rate"] == 1.0 and receipt["corrupted_pass_rate"] == 0.0
        ppo = _rows(run_dir, "ppo")
        assert [r["step"] for r in ppo] == [0, 1]
        assert all(r["rollout/engine_logprob_abs_diff"] < 1e-4 for r in ppo)
        assert all(("reward/prm_mean" in r) == (arm == "prm") for r in ppo)
        evaluation = json.loads((run_dir / "eval.json").read_text())
        assert {"sft", "ppo"} <= set(evaluation)

    # SFT ran once, with the templated prompts, and kept the template in its checkpoint's tokenizer
    (sft_dir,) = artifacts_dir.glob("sft-*")
    made = json.loads((sft_dir / "artifact.json").read_text())
    assert str(made["config"]["task"]["chat_template"]).lower() == "true"
    assert made["config"]["task"]["tokenizer_path"] == str(model_dir)
    assert load_tokenizer(sft_dir).chat_template == load_tokenizer(model_dir).chat_template
    assert len(list(artifacts_dir.glob("prm-*"))) == 1  # the PRM arm trained its PRM on Monte-Carlo labels


def test_jsonl_task_on_the_tiny_model_trains_sft_on_the_worked_solutions(smoke_cfg):
    # the first command of docs/own_data.md, one stage of it: model=tiny (no chat template) on the fixtures
    from prmppo.app import run

    cfg = smoke_cfg("stage=sft", "task=jsonl", f"task.train_path={TRAIN}", f"task.test_path={TEST}")
    summary = run(cfg)
    made = json.loads((Path(cfg.run_dir) / "init_model" / "prmppo_model.json").read_text())
    assert made["tokenizer"] == "char"  # every fixture example fits the smoke context one token per character
    tokenizer = load_tokenizer(summary["checkpoint"])
    task = build(cfg.task, "task")
    text = task.format_prompt(task.problems("sft")[0]) + task.problems("sft")[0].solution
    assert tokenizer.decode(tokenizer(text)["input_ids"], skip_special_tokens=True) == text  # no <unk>
    assert summary["test"]["n_problems"] == 8 and 0 <= summary["test"]["greedy_accuracy"] <= 1
