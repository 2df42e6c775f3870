"""The study's experiments (issue 19) compose: each sweep command in an experiment file's header, every
combination of its comma lists (seeds aside), validates; and the experiment's own keys win over
conf/config.yaml's."""

from __future__ import annotations

import itertools

import pytest

from conftest import REPO, compose_config
from prmppo.validate import validate_config

STUDY = ("prm_vs_orm_arith", "prm_vs_orm_sparse", "prm_hacking", "prm_vs_orm_flaw")


def header_sweeps(experiment: str) -> list[list[str]]:
    """The override lists of the `python -m prmppo -m ...` commands in the file's header comment."""
    lines = (REPO / "conf" / "experiment" / f"{experiment}.yaml").read_text().splitlines()
    commands = [line.lstrip("# ").split() for line in lines if line.startswith("#   python -m prmppo -m ")]
    return [words[4:] for words in commands]


def combinations(overrides: list[str]) -> list[list[str]]:
    """Every job of a basic-launcher sweep, seeds and hydra.* keys left out (they do not change the config's shape)."""
    kept = [o for o in overrides if not o.startswith(("seed=", "hydra."))]
    choices = [[f"{o.split('=', 1)[0]}={v}" for v in o.split("=", 1)[1].split(",")] for o in kept]
    return [list(c) for c in itertools.product(*choices)]


@pytest.mark.parametrize("experiment", STUDY)
def test_every_job_of_every_header_sweep_composes_and_validates(experiment):
    sweeps = header_sweeps(experiment)
    assert len(sweeps) >= 2 and all(f"experiment={experiment}" in s for s in sweeps)
    assert any("seed=0,1,2" in " ".join(s) for s in sweeps)
    for sweep in sweeps:
        for job in combinations(sweep):
            cfg = compose_config(job)
            validate_config(cfg)
            assert cfg.experiment_name == experiment  # the experiment's name, not config.yaml's default
    text = (REPO / "conf" / "experiment" / f"{experiment}.yaml").read_text()
    # the sweeps' runs are packed, and RESULTS.md is written from the archive (so reproduce.sh can regenerate it)
    archive = f"python -m prmppo.report.archive multirun/{experiment} --out experiments/{experiment}/runs.tar.xz"
    report = (f"python -m prmppo.report experiments/{experiment}/runs.tar.xz --out experiments/{experiment} "
              "--name RESULTS.md --threshold ")
    assert archive in text and report in text and (REPO / "experiments" / experiment / "README.md").exists()


def test_the_three_arms_of_the_main_comparison_are_orm_learned_and_oracle():
    jobs = [job for sweep in header_sweeps("prm_vs_orm_arith") for job in combinations(sweep)]
    rewards = {(cfg.arm.name, cfg.reward.get("scorer"), cfg.ppo.advantage_estimator, cfg.ppo.lam_actor)
               for cfg in map(compose_config, jobs)}
    assert rewards == {(arm, scorer, estimator, lam) for arm, scorer in (("orm", None), ("prm", "learned"),
                                                                       ("prm", "oracle"))
                       for estimator, lams in (("rloo", (1.0,)), ("gae", (0.95, 1.0))) for lam in lams}


def test_the_sparse_testbed_and_the_hacking_study_change_what_they_say():
    sparse = compose_config(["experiment=prm_vs_orm_sparse"])
    default = compose_config([])
    assert (sparse.task.rl.min_operands, sparse.task.rl.max_operands) == (5, 6)
    assert default.task.rl.max_operands < sparse.task.rl.max_operands
    hacking = compose_config(["experiment=prm_hacking"])
    arith = compose_config(["experiment=prm_vs_orm_arith"])  # the main study's PRM: the same head, 10x the steps
    assert hacking.prm_train.head == arith.prm_train.head and hacking.prm_train.steps * 10 == arith.prm_train.steps
    transforms = {job[-1] for sweep in header_sweeps("prm_hacking") for job in combinations(sweep)
                  if job[-1].startswith("reward.transform=")}
    assert transforms == {"reward.transform=plain", "reward.transform=delta", "reward.transform=min_form"}


def test_the_flaw_testbed_closes_the_temperature_channel_and_flaws_only_sft():
    flaw = compose_config(["experiment=prm_vs_orm_flaw", "arm=orm"])
    default = compose_config(["arm=orm"])
    assert (default.task.sft_flaw, default.task.sft_flaw_rate) == ("none", 0.0)  # the embedded default: no flaw
    assert flaw.task.sft_flaw == "carry" and flaw.task.sft_flaw_rate > 0.5  # the flawed step is the SFT's argmax
    assert list(default.lora.modules_to_save) == ["model.norm"] and list(flaw.lora.modules_to_save) == []
    assert flaw.eval.temperature == default.eval.temperature and flaw.ppo.kl_coef == default.ppo.kl_coef
    assert flaw.task.sft == default.task.sft and list(flaw.task.rl.operators) == ["+"]
