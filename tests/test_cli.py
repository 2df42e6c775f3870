"""`python -m prmppo` as a user types it after the install: its help, and the outcome-reward arm's whole
pipeline on smoke shapes, each in a subprocess started outside the repository (the process-reward arm's
pipeline runs in-process in tests/stages/test_stages_smoke.py). These are the fast tier's install checks."""

from __future__ import annotations

import json
from pathlib import Path

from conftest import REPO, run_prmppo


def test_help_lists_every_config_group(tmp_path):
    proc = run_prmppo(["--help"], cwd=tmp_path, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    groups = sorted(p.name for p in (REPO / "conf").iterdir() if p.is_dir() and not p.name.startswith("_"))
    assert len(groups) >= 10
    listed = {line.split(":", 1)[0].strip() for line in proc.stdout.splitlines() if ":" in line}
    assert set(groups) <= listed, f"groups missing from --help: {sorted(set(groups) - listed)}"


def test_orm_arm_pipeline_runs_from_the_command_line(tmp_path):
    run_dir, artifacts = tmp_path / "run", tmp_path / "artifacts"
    proc = run_prmppo(["debug=smoke", "arm=orm", f"hydra.run.dir={run_dir}", f"artifacts_dir={artifacts}"],
                      cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    evaluation = json.loads((run_dir / "eval.json").read_text())
    assert set(evaluation) == {"sft", "ppo", "delta"}
    assert json.loads((run_dir / "banner.json").read_text())["arm"] == "orm"
    assert list(artifacts.glob("sft-*")) and not list(artifacts.glob("prm-*"))  # the ORM arm trains no PRM
    assert Path(evaluation["ppo"]["checkpoint"]).is_dir()
