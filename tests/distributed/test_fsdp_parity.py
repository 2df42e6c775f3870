"""2 FSDP2 ranks (torchrun, gloo, CPU) train exactly like one process on the same global batch.

The 2-rank run splits every forward pass and every minibatch across the ranks, sums the gradients
in FSDP's reduce-scatter and the statistics with all-reduce; the 1-rank run does it all on one
process. Their per-iteration metrics agree within TOLERANCE, for both arms (the PRM arm with the
oracle step scorer: a learned PRM would add a minute of PRM training and no distributed code path)
and both LoRA settings, with the critic (gae, its replicated value head) in one case.

Why not exactly: the ranks run the same micro-batches as the one process (the plan's, dealt in
turn), so the rank split itself adds nothing a sum of two gradients would not; but FSDP's sharded
parameters (DTensors) round differently from plain tensors in the gradient norm and the AdamW
step, ~1e-7 relative after one step (one FSDP rank does the same), and this test's LR (0.05,
which moves the policy ~5 nats from the reference by iteration 2) amplifies that to ~1e-4 by the
third iteration. So the first iteration (one optimizer step per minibatch, before any rounding
can compound) is compared to FIRST_TOLERANCE and the later ones to TOLERANCE, both relative:
|a - b| <= tolerance x max(1, |a|), far below any real difference (a wrong denominator or a
missing rank's gradient moves the losses and the norms by tens of percent, from the first
iteration on).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import compose_config
from prmppo.app import run
from test_ranks import torchrun

FIRST_TOLERANCE = 1e-6  # the first iteration's metrics
TOLERANCE = 1e-3  # later iterations' metrics
# a large LR and an entropy bonus move the smoke policy every iteration (as in tests/stages/test_resume.py),
# so every iteration's metrics depend on the previous updates
MOVING = ["stage=ppo", "debug=smoke", "ppo.iterations=3", "ppo.lr=0.05", "ppo.warmup_steps=0", "ppo.entropy_coef=1.0",
          "logger.console=false"]
CPU_RANKS = ["topology=fsdp", "topology.train_device=cpu", "topology.engine_device=cpu", "topology.train_world_size=2"]


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory) -> Path:
    """The smoke SFT checkpoint every run of this module reuses (made once, by one process)."""
    root = tmp_path_factory.mktemp("fsdp_parity")
    run(compose_config(["debug=smoke", "stage=sft", f"artifacts_dir={root / 'artifacts'}"], run_dir=root / "sft"))
    return root / "artifacts"


def ppo_rows(run_dir: Path) -> list[dict]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [row for row in rows if row["stage"] in ("ppo", "ppo_eval")]


def _compared(row: dict) -> dict:
    return {k: v for k, v in row.items() if not k.startswith("perf/") and k != "time"}


def _close(a, b, tolerance: float) -> bool:
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return abs(a - b) <= tolerance * max(1.0, abs(a))
    return a == b


def differences(one: list[dict], two: list[dict]) -> list[str]:
    """Every metric (timings aside) that differs by more than FIRST_TOLERANCE (first iteration) or TOLERANCE
    (later ones) x max(1, |value|), and any key or row mismatch."""
    found = [] if len(one) == len(two) else [f"{len(one)} rows vs {len(two)}"]
    for a, b in zip(map(_compared, one), map(_compared, two)):
        found += [f"step {a['step']}: {k} in one run only" for k in sorted(set(a) ^ set(b))]
        tolerance = FIRST_TOLERANCE if a["step"] == 0 else TOLERANCE
        found += [f"step {a['step']} {k}: {a[k]} vs {b[k]}" for k in sorted(set(a) & set(b))
                  if not _close(a[k], b[k], tolerance)]
    return found


@pytest.mark.parametrize("case", [
    ["arm=orm", "lora=adapter"],
    ["arm=orm", "lora=none", "ppo.advantage_estimator=gae"],
    ["arm=prm", "reward=prm_oracle", "lora=adapter"],
    ["arm=prm", "reward=prm_oracle", "lora=none"],
    ["arm=orm", "lora=adapter", "rollout.sync=shared"],  # rank 0's gathered CPU copy through the shared buffer
    # compiled, checkpointed decoder layers inside FSDP2's units, against the same compiled layers on one process
    ["arm=prm", "reward=prm_oracle", "lora=adapter", "ppo.compile=true", "ppo.gradient_checkpointing=true"],
], ids=["orm-adapter", "orm-none-gae", "prm-adapter", "prm-none", "orm-adapter-shared", "prm-adapter-compiled"])
def test_two_ranks_equal_one_process(artifacts, tmp_path, case):
    overrides = [*MOVING, f"artifacts_dir={artifacts}", *case]
    run(compose_config(overrides, run_dir=tmp_path / "one"))
    proc = torchrun(["-m", "prmppo", *overrides, *CPU_RANKS, f"hydra.run.dir={tmp_path / 'two'}"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    one, two = ppo_rows(tmp_path / "one"), ppo_rows(tmp_path / "two")
    assert len([r for r in one if r["stage"] == "ppo"]) == 3
    assert any(abs(r["ppo/policy_grad_norm"]) > 1e-3 for r in one if r["stage"] == "ppo")  # the policy moved
    assert differences(one, two) == []
    # the engine sampled with the weights each sync shipped (what a stale or wrong copy would break)
    assert all(r["rollout/engine_logprob_abs_diff"] < 1e-4 for r in two if r["stage"] == "ppo")
    # rank 0 alone writes the run's files; each rank logs to its own
    written = {p.name for p in (tmp_path / "two").iterdir()}
    assert {"metrics.jsonl", "banner.json", "stage_result.json", "rank0.log", "rank1.log"} <= written
    result = json.loads((tmp_path / "two" / "stage_result.json").read_text())
    published = Path(result["summary"]["artifact"])
    assert (published / "config.json").is_file() and (published / "model.safetensors").is_file()
