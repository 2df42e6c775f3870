"""The README's test command (`python -m pytest -q`) runs the fast tier: pyproject.toml's addopts leave the
`slow` tests out, `python -m pytest -q -m slow` runs them, and CI (`.ci/run`) runs both.

What a fresh install can break stays in the fast tier: the entry point and its help, a smoke pipeline
under each arm, every shipped config composing, and where the config and its paths are found."""

from __future__ import annotations

import subprocess
import sys
import tomllib

from conftest import REPO

# files whose every test runs in the default (fast) tier
INSTALL_CHECKS = ["tests/test_cli.py", "tests/config/test_compose.py", "tests/config/test_paths.py"]
# single tests of mixed files that run in the default tier too
INSTALL_TESTS = ["tests/stages/test_stages_smoke.py::test_pipeline_smoke_writes_eval_of_both_policies",
                 "tests/stages/test_stages_smoke.py::test_sft_smoke_trains_saves_and_reports"]


def collected(*args: str) -> set[str]:
    """The test ids `python -m pytest <args>` would run (pyproject.toml's addopts included)."""
    proc = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *args],
                          cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode in (0, 5), proc.stdout[-3000:] + proc.stderr[-3000:]  # 5: every test deselected
    return {line.strip() for line in proc.stdout.splitlines() if "::" in line}


def test_the_default_run_holds_the_install_checks_and_leaves_the_slow_tier_out():
    files = sorted({*INSTALL_CHECKS, *(test.split("::")[0] for test in INSTALL_TESTS), "tests/ppo/test_loop.py"})
    default = collected(*files)
    everything = collected("-m", "slow or not slow", *files)
    in_checked_files = {test for test in everything if test.split("::")[0] in INSTALL_CHECKS}
    assert in_checked_files and in_checked_files <= default
    assert {test.split("[")[0] for test in default} >= set(INSTALL_TESTS)
    # tests/ppo/test_loop.py has a slow test (compiled layers): the default run leaves it out
    assert default < everything
    assert "tests/ppo/test_loop.py::test_compiled_layers_give_the_eager_logprobs_and_gradients" in everything - default


def test_ci_runs_both_tiers_with_the_vllm_engine_required():
    text = (REPO / ".ci" / "run").read_text()
    assert 'PRMPPO_REQUIRE_VLLM=1 python -m pytest -q -m "slow or not slow"' in text
    pytest_ini = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]
    assert "-m 'not slow'" in pytest_ini["addopts"] and any(m.startswith("slow:") for m in pytest_ini["markers"])
