"""`stage=sft`, `stage=prm` and `stage=pipeline` on 2 FSDP2 ranks (torchrun, gloo, CPU).

SFT and PRM train data-parallel: every rank draws the same batch and trains on its half, the loss is
normalised by the global token count (SFT) or step-weight sum (PRM), FSDP sums the gradients. So
the 2-rank run's logged metrics (loss, gradient norm, learning rate, accuracies) and its published
weights equal the 1-process run's within TOLERANCE.

Why not exactly: the same numbers are summed in another order (each rank sums the cross-entropy of
its own rows, then the two partial sums are all-reduced; FSDP's reduce-scatter sums the two
gradients; the global gradient norm is reduced from the ranks' shards), and FSDP's sharded
(DTensor) AdamW step rounds differently from a plain one. Measured on the smoke runs: ~1e-7
relative on the losses and gradient norms, ~1e-7 absolute on the weights (tied embeddings ~1,
LoRA factors ~0.2) after 20 SFT / 10 PRM steps. TOLERANCE is 1e-5: a hundred times that, and far
below what a real fault does. A loss normalised by each rank's own count instead of the global one
doubles the logged loss and the gradient norm (AdamW's scale invariance would hide it in the
weights, the metrics do not); a rank's rows left out of the gradient change its direction, hence
the signs AdamW steps on, up to 2 x sft.lr (6e-3) per weight in a step.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from safetensors.torch import load_file

from conftest import compose_config
from prmppo.app import run
from test_fsdp_parity import CPU_RANKS
from test_ranks import torchrun

TOLERANCE = 1e-5  # relative on metrics (x max(1, |value|)), absolute on weights


def _rows(run_dir: Path, stage: str) -> list[dict]:
    """The stage's metrics rows, timings left out (they differ between any two runs)."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [{k: v for k, v in row.items() if k != "time" and not k.startswith("perf/") and not k.endswith("seconds")}
            for row in rows if row["stage"] == stage]


def _close(a, b) -> bool:
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return abs(a - b) <= TOLERANCE * max(1.0, abs(a))
    return a == b  # the stage's name


def metric_differences(one: list[dict], two: list[dict]) -> list[str]:
    """Every metric that differs by more than TOLERANCE x max(1, |value|), and any key or row mismatch."""
    found = [] if len(one) == len(two) else [f"{len(one)} rows vs {len(two)}"]
    for a, b in zip(one, two):
        found += [f"step {a['step']}: {k} in one run only" for k in sorted(set(a) ^ set(b))]
        found += [f"step {a['step']} {k}: {a[k]} vs {b[k]}" for k in sorted(set(a) & set(b)) if not _close(a[k], b[k])]
    return found


def weight_differences(one: Path, two: Path) -> dict[str, float]:
    """Every tensor of two safetensors files whose largest absolute difference exceeds TOLERANCE."""
    a, b = load_file(str(one)), load_file(str(two))
    assert sorted(a) == sorted(b)
    gaps = {name: float((a[name].float() - b[name].float()).abs().max()) for name in a}
    return {name: gap for name, gap in gaps.items() if gap > TOLERANCE}


def _summary(run_dir: Path) -> dict:
    result = json.loads((run_dir / "stage_result.json").read_text())
    assert result["status"] == "ok"
    return result["summary"]


def _two_ranks(overrides: list[str], run_dir: Path) -> None:
    proc = torchrun(["-m", "prmppo", *overrides, *CPU_RANKS, f"hydra.run.dir={run_dir}"], cwd=run_dir.parent)
    assert proc.returncode == 0, proc.stderr[-4000:]
    written = {p.name for p in run_dir.iterdir()}
    assert {"metrics.jsonl", "stage_result.json", "rank0.log", "rank1.log"} <= written


def test_sft_on_two_ranks_equals_one_process(tmp_path):
    smoke = ["stage=sft", "debug=smoke", "logger.console=false"]
    run(compose_config([*smoke, f"artifacts_dir={tmp_path / 'art_one'}"], run_dir=tmp_path / "one"))
    _two_ranks([*smoke, f"artifacts_dir={tmp_path / 'art_two'}"], tmp_path / "two")

    one, two = _rows(tmp_path / "one", "sft"), _rows(tmp_path / "two", "sft")
    assert [r["step"] for r in one] == [0, 19, 20]  # the first and last steps, then the evaluation
    assert one[1]["sft/loss"] < one[0]["sft/loss"] - 0.1  # the model learned: the comparison is not of a still model
    assert metric_differences(one, two) == []
    first, second = _summary(tmp_path / "one"), _summary(tmp_path / "two")
    # the loss EMA reads every step's loss, not only the logged ones
    assert abs(first["final_loss_ema"] - second["final_loss_ema"]) <= TOLERANCE * first["final_loss_ema"]
    assert first["test"] == second["test"] and first["response_tokens"] == second["response_tokens"]
    published = [Path(s["checkpoint"]) for s in (first, second)]
    assert (published[1] / "config.json").is_file() and (published[1] / "tokenizer.json").is_file()
    assert weight_differences(*(p / "model.safetensors" for p in published)) == {}


def test_prm_on_two_ranks_equals_one_process(tmp_path):
    smoke = ["debug=smoke", "logger.console=false"]
    run(compose_config(["stage=sft", *smoke, f"artifacts_dir={tmp_path / 'art_one'}"], run_dir=tmp_path / "sft"))
    shutil.copytree(tmp_path / "art_one", tmp_path / "art_two")  # both PRMs train on the same SFT checkpoint
    prm = ["stage=prm", *smoke]
    run(compose_config([*prm, f"artifacts_dir={tmp_path / 'art_one'}"], run_dir=tmp_path / "one"))
    _two_ranks([*prm, f"artifacts_dir={tmp_path / 'art_two'}"], tmp_path / "two")

    one, two = _rows(tmp_path / "one", "prm"), _rows(tmp_path / "two", "prm")
    assert [r["step"] for r in one] == [0, 9, 10]  # the first and last steps, then the evaluation
    assert metric_differences(one, two) == []
    first, second = _summary(tmp_path / "one"), _summary(tmp_path / "two")
    assert first["labels"]["examples"] == second["labels"]["examples"] > 0  # rank 0's labels on both ranks
    assert abs(first["train"]["final_loss_ema"] - second["train"]["final_loss_ema"]) <= TOLERANCE
    dirs = [Path(s["prm_dir"]) for s in (first, second)]
    assert (dirs[1] / "prm_meta.json").is_file()
    head = load_file(str(dirs[0] / "prm_head.safetensors"))
    assert float(head["linear.weight"].abs().max()) > 1e-3  # zero-initialised: it trained
    assert weight_differences(dirs[0] / "prm_head.safetensors", dirs[1] / "prm_head.safetensors") == {}
    adapter = Path("prm") / "adapter_model.safetensors"
    assert weight_differences(dirs[0] / adapter, dirs[1] / adapter) == {}


def test_pipeline_on_two_ranks_ends_with_one_stage_result(tmp_path):
    run_dir = tmp_path / "pipe"
    _two_ranks(["debug=smoke", "arm=orm", "ppo.iterations=1", "logger.console=false",
                f"artifacts_dir={tmp_path / 'artifacts'}"], run_dir)
    assert [p.relative_to(run_dir) for p in run_dir.rglob("stage_result.json")] == [Path("stage_result.json")]
    result = json.loads((run_dir / "stage_result.json").read_text())
    assert (result["status"], result["stage"], result["arm"]) == ("ok", "pipeline", "orm")
    summary = result["summary"]
    assert "reused" not in summary["sft"] and summary["sft"]["train_seconds"] > 0  # trained by the two ranks
    assert summary["prm"] is None  # arm=orm needs no PRM
    assert summary["ppo"]["iterations"] == 1 and Path(summary["ppo"]["checkpoint"]).is_dir()
    assert set(summary["eval"]) == {"sft", "ppo"} and "greedy_accuracy" in summary["delta"]
    stages = {json.loads(line)["stage"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()}
    assert {"sft", "ppo", "eval"} <= stages
