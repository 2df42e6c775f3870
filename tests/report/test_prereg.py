"""prmppo.report.prereg on synthetic study archives laid out as the real study's (`<root>/ppo/<arm>/s<seed>`,
`<root>/prm/<id>/s<seed>`, `<root>/sft/s<seed>`), with configs composed from the real experiment file and
per-problem outcomes whose accuracies are chosen here, so every endpoint is known by hand:

- the primary endpoints (seed-level differences, t interval, p, area, bootstrap mean) equal hand-worked values;
- Holm's adjustment and the verdicts (superior, inferior, equivalent, inconclusive) by hand;
- missing and failed runs and missing evaluations are listed, and their seeds drop out, without a crash;
- the same archive gives the same markdown byte for byte, twice and from another working directory;
- a bad study file, a run contradicting its place, or outcomes contradicting their metrics row are refused.
"""

from __future__ import annotations

import json
import math
import os
import random
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from omegaconf import OmegaConf
from scipy import stats

from conftest import compose_config
from prmppo.report.archive import pack_bytes
from prmppo.report.prereg import endpoints, load_spec, read_study, write_results
from prmppo.report.prereg.__main__ import main as prereg_main
from prmppo.report.prereg.endpoints import Result, family
from prmppo.report.prereg.spec import Endpoint, SpecError
from prmppo.report.runs import ReportError
from prmppo.report.stats import Interval, tost

REPO = Path(__file__).resolve().parents[2]
STUDY_FILE = REPO / "experiments" / "prm_vs_orm_flaw" / "study.yaml"
PROBLEMS = 20
K = 8
ITERATIONS = (0, 25, 50, 75, 100)
OVERRIDES = {"orm": ["arm=orm"], "prm": ["arm=prm"], "oracle": ["arm=prm", "reward=prm_oracle"],
             "orm_gae": ["arm=orm", "ppo.advantage_estimator=gae", "ppo.lam_actor=0.95"],
             "prm_gae": ["arm=prm", "ppo.advantage_estimator=gae", "ppo.lam_actor=0.95"],
             "orm_matched": ["arm=orm", "ppo.iterations=150"]}
PRIMARY_SEEDS, SECONDARY_SEEDS = (0, 1, 2, 3), (0, 1)


def greedy_right(arm: str, seed: int, iteration: int) -> int:
    """Problems (of 20) the greedy policy gets right: orm 2 + 3 per 25 iterations + seed; prm 2 more from
    iteration 25 on, 1 more again on odd seeds (differences 2, 3, 2, 3 problems = 0.10, 0.15, 0.10, 0.15)."""
    right = 2 + 3 * (iteration // 25) + seed  # at most 15, and 18 with prm's
    if arm != "orm" and iteration > 0:
        right += 2 + seed % 2
    return min(right, PROBLEMS)


def pass_right(arm: str, seed: int, iteration: int) -> int:
    """Problems with at least one of 8 samples right: prm equals orm exactly (a difference of 0 on every seed)."""
    return min(10 + 2 * (iteration // 25) + (seed % 2), PROBLEMS)


def outcomes(arm: str, seed: int, iteration: int, tag: str) -> list[dict]:
    """Per-problem rows with `greedy_right` greedy verdicts and `pass_right` problems passing, on shuffled
    problems (a fixed stream per arm, seed, iteration)."""
    rng = random.Random(f"{arm}-{seed}-{iteration}-{tag}")
    greedy, passing = list(range(PROBLEMS)), list(range(PROBLEMS))
    rng.shuffle(greedy)
    rng.shuffle(passing)
    g, p = set(greedy[:greedy_right(arm, seed, iteration)]), set(passing[:pass_right(arm, seed, iteration)])
    return [{"index": i, "id": f"p{i:02d}", "difficulty": {"operands": 3 + i % 2, "carries": i % 3},
             "greedy_correct": i in g, "correct_of_k": rng.randint(1, K) if i in p else 0, "k": K}
            for i in range(PROBLEMS)]


def _accuracies(rows: list[dict]) -> dict:
    n = len(rows)
    return {"greedy_accuracy": sum(r["greedy_correct"] for r in rows) / n,
            "sampled_accuracy": sum(r["correct_of_k"] / K for r in rows) / n,
            f"pass@{K}": sum(r["correct_of_k"] > 0 for r in rows) / n, "n_problems": float(n)}


def _write_json(path: Path, data) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, sort_keys=True))


def write_ppo_run(run: Path, config, arm: str, seed: int, iterations=ITERATIONS) -> None:
    """A PPO pipeline run as the study's sweep writes it."""
    (run / ".hydra").mkdir(parents=True)
    OmegaConf.save(config, run / ".hydra" / "config.yaml")
    # as final.py types them: the shared artifacts and the run dir are paths of the machine that ran them
    typed = ["experiment=prm_vs_orm_flaw", "logger.console=false", f"artifacts_dir={run.parents[3] / 'artifacts'}",
             f"hydra.run.dir={run}", *OVERRIDES[arm], f"seed={seed}"]
    OmegaConf.save(OmegaConf.create(typed), run / ".hydra" / "overrides.yaml")
    rows = []
    for it in iterations:
        problems = outcomes(arm, seed, it, "ppo_eval")
        _write_json(run / "ppo_eval" / f"iteration_{it:05d}.json",
                    {"ppo_iterations": it, "k": K, "temperature": 1.0, "problems": problems})
        acc = _accuracies(problems)
        rows.append({"stage": "ppo_eval", "step": max(it - 1, 0), "eval/ppo_iterations": it,
                     "eval/test_greedy_accuracy": acc["greedy_accuracy"], "eval/n_problems": PROBLEMS,
                     "eval/test_sampled_accuracy": acc["sampled_accuracy"], f"eval/test_pass@{K}": acc[f"pass@{K}"]})
    for step in range(iterations[-1]):
        row = {"stage": "ppo", "step": step, "reward/total_mean": step / 100}
        if arm != "orm" and not arm.startswith("orm_"):
            row.update({"prm/score_mean": 0.6 + step / 400 + seed / 100, "hack/true_step_accuracy": 0.5 + step / 300,
                        "prm/flipped_fraction": 0.1 if arm == "oracle" else 0.0})
        rows.append(row)
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    final = {name: {**_accuracies(p), "problems": p} for name, p in
             (("sft", outcomes("sft", seed, 0, "final")), ("ppo", outcomes(arm, seed, iterations[-1], "final")))}
    _write_json(run / "eval.json", final)
    _write_json(run / "stage_result.json", {"status": "ok", "stage": "pipeline", "arm": str(config.arm.name),
                                            "seed": seed, "summary": {}})
    _write_json(run / "run_info.json", {"code": {"commit": "0123abc" * 6, "dirty": False}, "device": "cuda",
                                        "versions": {"torch": "2.11.0", "transformers": "5.24.0", "peft": "0.21.2"}})


def write_prm_run(run: Path, seed: int) -> None:
    (run / ".hydra").mkdir(parents=True)
    (run / ".hydra" / "config.yaml").write_text("stage: prm\n")
    evaluation = {"step_accuracy": 0.8 + seed / 100, "step_accuracy_right_steps": 0.9, "step_accuracy_wrong_steps": 0.5,
                  "first_error_f1": 0.6, "bon/best_of_n": 8.0, "bon/min_accuracy": 0.5 + seed / 100,
                  "bon/product_accuracy": 0.45, "bon/mean_accuracy": 0.4, "bon/last_accuracy": 0.42,
                  "bon/majority_accuracy": 0.3, "bon/oracle_accuracy": 0.7}
    _write_json(run / "stage_result.json", {"status": "ok", "stage": "prm", "summary": {"eval": evaluation}})


@pytest.fixture(scope="module")
def configs() -> dict:
    return {arm: compose_config(["experiment=prm_vs_orm_flaw", *o]) for arm, o in OVERRIDES.items()}


def study_spec(path: Path, **changes) -> Path:
    """The committed study file, shrunk to the fixture's seeds and arms, with `changes` on top."""
    node = yaml.safe_load(STUDY_FILE.read_text())
    node["seeds"] = "0-3"
    node["secondary"] = [dict(c, seeds="0-1") for c in node["secondary"] if c["arm"] in ("oracle", "prm_gae")]
    node["compute_matched"]["seeds"] = "0-1"
    node["prm_quality"] = [{"id": "default", "label": "learned PRM", "seeds": "0-3"}]
    node.update(changes)
    path.write_text(yaml.safe_dump(node, sort_keys=False))
    return path


@pytest.fixture
def tree(tmp_path, configs) -> Path:
    """`<tmp>/runs/final/...`: every run the shrunk study file names, plus one it does not."""
    top = tmp_path / "runs" / "final"
    plan = [(arm, PRIMARY_SEEDS) for arm in ("orm", "prm")] + \
        [(arm, SECONDARY_SEEDS) for arm in ("oracle", "orm_gae", "prm_gae", "orm_matched")] + [("oracle", (7,))]
    for arm, seeds in plan:
        for seed in seeds:
            config = configs[arm].copy()
            config.seed = seed
            its = (*ITERATIONS, 125, 150) if arm == "orm_matched" else ITERATIONS
            write_ppo_run(top / "ppo" / arm / f"s{seed}", config, arm, seed, its)
    for seed in PRIMARY_SEEDS:
        write_prm_run(top / "prm" / "default" / f"s{seed}", seed)
        (top / "sft" / f"s{seed}" / ".hydra").mkdir(parents=True)
        (top / "sft" / f"s{seed}" / ".hydra" / "config.yaml").write_text("stage: sft\n")
    return tmp_path / "runs"


def archive(tree: Path, out: Path) -> Path:
    files = {p.relative_to(tree).as_posix(): p for p in sorted(tree.rglob("*")) if p.is_file()}
    out.write_bytes(pack_bytes(files))
    return out


def test_primary_endpoints_equal_the_hand_worked_values(tree, tmp_path):
    spec = load_spec(study_spec(tmp_path / "study.yaml"))
    study = read_study(tree, spec)
    results = {r.endpoint.id: r for r in endpoints.primary(study)}
    # P1 (greedy, iteration 25): prm - orm = 2, 3, 2, 3 problems of 20 = 0.10, 0.15, 0.10, 0.15 by seed:
    # mean 0.125, sd = sqrt(4 * 0.025^2 / 3) = 0.0288675, t(0.975, 3) = 3.182446 -> half width 0.0459340
    p1 = results["P1"]
    assert [b - a for a, b in (p1.per_seed[s][::-1] for s in PRIMARY_SEEDS)] == pytest.approx([0.10, 0.15, 0.10, 0.15])
    assert p1.mean(1) == pytest.approx((5 + 6 + 7 + 8) / 4 / 20)  # orm: 2 + 3 + seed right of 20
    assert (p1.t.mean, p1.t.low, p1.t.high) == pytest.approx((0.125, 0.125 - 0.0459340, 0.125 + 0.0459340), abs=1e-6)
    # t = 0.125 / (0.0288675 / 2) = 8.660254 on 3 df; two-sided p from scipy's paired test
    assert p1.p == pytest.approx(stats.ttest_rel([0.35, 0.45, 0.45, 0.55], [0.25, 0.3, 0.35, 0.4]).pvalue)
    assert p1.p == pytest.approx(2 * stats.t.sf(8.660254, 3), rel=1e-5)
    # every seed has 20 problems, so the bootstrap's point estimate is the mean seed difference
    assert p1.bootstrap.mean == pytest.approx(0.125) and p1.bootstrap.n == 4
    # P7, the area: the trapezoid over 0, 25, ..., 100 divided by 100 = (y0/2 + y25 + y50 + y75 + y100/2) / 4;
    # prm - orm is 0 at iteration 0 and 0.10 / 0.15 after it: (0 + 3 d + d / 2) / 4 = 0.875 d
    assert [p[0] - p[1] for p in results["P7"].per_seed.values()] == pytest.approx([0.0875, 0.13125, 0.0875, 0.13125])
    assert results["P7"].bootstrap is None
    # P4-P6 (pass@8): identical in both arms on every seed: mean 0, no spread, p 1, equivalent (|0| < 0.05)
    assert results["P6"].t.mean == 0 and results["P6"].p == 1.0 and results["P6"].verdict == "equivalent"
    # Holm over 7: P1-P3 and P7 have p ~ 1e-3, x at most 7 stays < 0.05 -> superior
    assert [results[e].verdict for e in ("P1", "P2", "P3", "P7")] == ["superior"] * 4
    text = write_results(tree, tmp_path / "study.yaml", tmp_path / "out").read_text()
    assert "| P1 | greedy accuracy, iteration 25 | 0.325 | 0.450 | +0.125 | [+0.079, +0.171] |" in text
    # the PRM arms during PPO: the score averaged over iterations 0-99 is 0.6 + 99 / 800 + seed / 100, so over seeds
    # 0 and 1 0.72875; the oracle flipped 10% of its step scores, so its verdicts are right on 90% of the steps
    assert "| `oracle` | oracle PRM | 0-1 | 0.729 ± 0.064 | 0.665 ± 0.000 | 0.100 ± 0.000 | 0.900 ± 0.000 |" in text
    assert "| `prm` | learned PRM | 0-3 | 0.739 ± 0.021 | 0.665 ± 0.000 | 0.000 ± 0.000 | - |" in text


def _result(p: float, diffs: list[float]) -> Result:
    endpoint = Endpoint("E", "e", "greedy", 25, None)
    mean = sum(diffs) / len(diffs)
    return Result(endpoint, "prm", "orm", {s: (d, 0.0) for s, d in enumerate(diffs)},
                  Interval(mean, math.nan, math.nan, len(diffs), "t"), None, p, tost(diffs, 0.05))


def test_holm_adjusts_over_the_family_and_the_verdicts_follow():
    # p = 0.01, 0.04, 0.03: sorted 0.01 x 3 = 0.03, 0.03 x 2 = 0.06, 0.04 x 1 = 0.04 -> running max 0.03, 0.06, 0.06
    wide = [0.3, -0.2, 0.4, -0.1]  # mean 0.1, TOST cannot show equivalence
    got = family([_result(0.01, wide), _result(0.04, wide), _result(0.03, [-x for x in wide])], alpha=0.05)
    assert [r.p_holm for r in got] == pytest.approx([0.03, 0.06, 0.06])
    assert [r.verdict for r in got] == ["superior", "inconclusive", "inconclusive"]
    # negative mean with Holm p < alpha: inferior; tight differences inside the margin: equivalent, and both
    tight = [0.01, 0.012, 0.011, 0.009]
    got = family([_result(0.001, [-x for x in wide]), _result(0.5, [0.0, 0.01, -0.01, 0.0]), _result(0.002, tight)],
                 alpha=0.05)
    assert [r.verdict for r in got] == ["inferior", "equivalent", "superior and equivalent"]
    # an endpoint without a p (one seed) enters as p = 1: the family keeps its size, its own p_holm is n/a
    got = family([_result(0.02, wide), _result(math.nan, [0.1])], alpha=0.05)
    assert got[0].p_holm == pytest.approx(0.04) and math.isnan(got[1].p_holm) and got[1].verdict == "n/a"


def test_missing_and_failed_runs_are_listed_and_their_seeds_drop_out(tree, tmp_path):
    top = tree / "final"
    shutil.rmtree(top / "ppo" / "prm" / "s3")
    result = json.loads((top / "ppo" / "orm" / "s2" / "stage_result.json").read_text())
    result.update(status="failed", error={"message": "CUDA out of memory\nmore", "type": "RuntimeError"})
    _write_json(top / "ppo" / "orm" / "s2" / "stage_result.json", result)
    (top / "ppo" / "orm" / "s1" / "ppo_eval" / "iteration_00050.json").unlink()
    shutil.rmtree(top / "prm" / "default" / "s0")
    metrics = top / "ppo" / "prm" / "s1" / "metrics.jsonl"
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    for row in rows:  # the pass@8 of the last evaluation not logged
        if row["stage"] == "ppo_eval" and row["eval/ppo_iterations"] == 100:
            del row[f"eval/test_pass@{K}"]
    metrics.write_text("".join(json.dumps(r) + "\n" for r in rows))
    text = write_results(archive(tree, tmp_path / "runs.tar.xz"), study_spec(tmp_path / "study.yaml"),
                         tmp_path / "out").read_text()
    missing = text[text.index("## Missing runs"):]
    assert "| `ppo/orm/s1` | no per-problem outcomes (ppo_eval/) after 50 iterations |" in missing
    assert "| `ppo/orm/s2` | status failed: CUDA out of memory |" in missing
    assert "| `ppo/prm/s3` | no run |" in missing and "| `prm/default/s0` | no run |" in missing
    assert "| `ppo/prm/s1` | no eval/test_pass@8 in the ppo_eval rows after 100 iterations |" in missing
    assert "not named by the study file (not analysed): `ppo/oracle/s7`." in missing
    study = read_study(tree, load_spec(tmp_path / "study.yaml"))
    results = {r.endpoint.id: r for r in endpoints.primary(study)}
    assert results["P1"].seeds == [0, 1] and results["P2"].bootstrap.n == 1  # seed 1 has no outcomes at 50
    assert results["P6"].seeds == [0] and results["P6"].verdict == "n/a"  # seed 1 has no pass@8 after 100
    assert "| P2 | greedy accuracy, iteration 50 |" in text and "(n=1) |" in text
    assert "| 2 | missing | missing |" in text and "| 3 | missing |" in text  # the per-seed appendix
    assert "| `orm` | baseline | ORM |" in text and "| 0-1, 3 | 2 |" in text  # seeds read, seeds missing


def test_the_same_archive_gives_the_same_bytes_from_any_directory(tree, tmp_path):
    study_dir = tmp_path / "study"
    study_dir.mkdir()
    archive(tree, study_dir / "runs.tar.xz")
    study_spec(study_dir / "study.yaml")
    (study_dir / "deviations.txt").write_text("## Deviations\n\nNone.\n")
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
    command = [sys.executable, "-m", "prmppo.report.prereg", "runs.tar.xz", "--spec", "study.yaml", "--out", ".",
               "--name", "RESULTS.md", "--preamble", "deviations.txt"]
    subprocess.run(command, cwd=study_dir, env=env, check=True, capture_output=True)
    first = (study_dir / "RESULTS.md").read_bytes()
    other = tmp_path / "elsewhere"
    other.mkdir()
    assert prereg_main([str(study_dir / "runs.tar.xz"), "--spec", str(study_dir / "study.yaml"), "--out",
                        str(other), "--preamble", str(study_dir / "deviations.txt")]) == 0
    assert (other / "RESULTS.md").read_bytes() == first
    text = first.decode()
    assert text.startswith("# prm_vs_orm_flaw: PRM vs ORM on the carry-flaw testbed\n\n## Deviations\n\nNone.\n")
    assert str(tmp_path) not in text and "prmppo-report-" not in text
    for figure in ("accuracy_primary.png", "accuracy_secondary.png", "prm_vs_true_step.png"):
        assert f"]({figure})" in text and (other / figure).read_bytes() == (study_dir / figure).read_bytes()
    for section in ("## Primary endpoints", "### SECONDARY: Oracle PRM", "### SECONDARY: Estimator GAE",
                    "### SECONDARY: Compute-matched ORM", "## Accuracy per difficulty (EXPLORATORY)",
                    "## PRM quality", "## Appendix: primary endpoints per seed", "## Missing runs"):
        assert section in text


def _spec_error(tmp_path, **changes) -> str:
    with pytest.raises(SpecError) as err:
        load_spec(study_spec(tmp_path / "study.yaml", **changes))
    return str(err.value)


def test_a_bad_study_file_is_refused_naming_the_key(tmp_path, tree):
    assert "study.yaml: margins is not a key of the study file here" in _spec_error(tmp_path, margins=0.05)
    node = yaml.safe_load(STUDY_FILE.read_text())
    endpoints_with_typo = node["endpoints"][:1] + [dict(node["endpoints"][1], metrc="greedy")]
    assert "endpoints[1].metrc is not a key" in _spec_error(tmp_path, endpoints=endpoints_with_typo)
    bad_metric = [dict(node["endpoints"][0], metric="pass_at_8")]
    assert "endpoints[0].metric must be greedy, sampled or pass@K, got 'pass_at_8'" in _spec_error(
        tmp_path, endpoints=bad_metric)
    assert "seeds must be a list of distinct seeds >= 0 or a range" in _spec_error(tmp_path, seeds="3-1")
    assert "margin must lie in (0, 1), got 5" in _spec_error(tmp_path, margin=5)
    assert "secondary[0].seeds is required" in _spec_error(tmp_path, secondary=[{"arm": "oracle", "against": "orm",
                                                                                  "label": "x", "description": "y"}])
    spec = study_spec(tmp_path / "study.yaml", root="results")
    with pytest.raises(SpecError, match=r"root 'results' is not a directory of the archive \(it holds: final\)"):
        read_study(tree, load_spec(spec))
    (tmp_path / "broken.yaml").write_text("title: [unclosed\n")
    assert prereg_main([str(tree), "--spec", str(tmp_path / "broken.yaml"), "--out", str(tmp_path / "o")]) == 2


def read_study_results(tree: Path, spec: Path) -> list[Result]:
    return endpoints.primary(read_study(tree, load_spec(spec)))


def test_a_run_contradicting_its_place_or_its_metrics_is_refused(tree, tmp_path):
    spec = study_spec(tmp_path / "study.yaml")
    file = tree / "final" / "ppo" / "prm" / "s1" / "ppo_eval" / "iteration_00025.json"
    data = json.loads(file.read_text())
    data["problems"][0]["greedy_correct"] = not data["problems"][0]["greedy_correct"]
    file.write_text(json.dumps(data))
    runs = archive(tree, tmp_path / "runs.tar.xz")
    with pytest.raises(ReportError, match=r"runs\.tar\.xz:final/ppo/prm/s1/ppo_eval/iteration_00025\.json: greedy "
                                          r"over its problems is 0\.\d+, the ppo_eval row after 25 iterations logged"):
        write_results(runs, spec, tmp_path / "out")
    data["problems"][0]["greedy_correct"] = not data["problems"][0]["greedy_correct"]  # agrees again
    for row in data["problems"]:  # 4 samples a problem, where the study's pass@8 needs 8
        row["k"] = 4
    file.write_text(json.dumps(data))
    with pytest.raises(ReportError, match=r"pass@8 of prm / orm: the per-problem outcomes hold 4 samples a problem"):
        read_study_results(tree, spec)
    shutil.rmtree(tree / "final" / "ppo" / "prm" / "s1")
    shutil.copytree(tree / "final" / "ppo" / "prm" / "s2", tree / "final" / "ppo" / "prm" / "s1")
    with pytest.raises(ReportError, match=r"prm/s1/\.hydra/config\.yaml: seed 2, but its directory says s1"):
        read_study(tree, load_spec(spec))


def test_the_study_reproduce_script_passes_check_reproduce(tree, tmp_path):
    # the study's committed reproduce.sh, pre-registration and README beside a synthetic archive; check_reproduce
    # must keep PREREGISTRATION.md (an input, not an output)
    study_dir = tmp_path / "root" / "prm_vs_orm_flaw"
    study_dir.mkdir(parents=True)
    source = STUDY_FILE.parent
    for name in ("README.md", "PREREGISTRATION.md"):
        shutil.copy(source / name, study_dir / name)
    shutil.copy(source / "reproduce.sh", study_dir / "reproduce.sh")
    archive(tree, study_dir / "runs.tar.xz")
    study_spec(study_dir / "study.yaml")
    (study_dir / "deviations.txt").write_text("## Deviations from the pre-registration\n\nNone.\n")
    env = {**os.environ, "PYTHON": sys.executable, "PYTHONPATH": str(REPO / "src")}
    subprocess.run(["bash", str(study_dir / "reproduce.sh")], cwd=tmp_path, env=env, check=True, capture_output=True)
    assert (study_dir / "RESULTS.md").read_text().startswith("# prm_vs_orm_flaw")
    proc = subprocess.run(["bash", str(REPO / "scripts" / "check_reproduce.sh"), str(tmp_path / "root")],
                          capture_output=True, text=True, env=env)
    assert proc.returncode == 0 and "check_reproduce: prm_vs_orm_flaw: ok" in proc.stdout, proc.stdout + proc.stderr
