"""prmppo.report: intervals against hand-computed numbers, grouping rules on synthetic runs, bad inputs,
and the CLI on a real tiny multirun (2 arms x 2 seeds)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
from omegaconf import OmegaConf
from scipy import stats

from conftest import compose_config
from prmppo.report import (HACK_METRICS, ReportError, accuracy_figure, difference_ci, difference_rows, find_runs, group_rows,
                           group_runs, mean_ci, measures, metrics_figure, write_report)
from prmppo.report.__main__ import main as report_main
from prmppo.report.hacking import early_means, first_gap, gap_change, hacking_section, late_means
from prmppo.report.sweeps import find_sweeps, sweeps_section
from prmppo.report.tables import iterations_to


def test_mean_ci_is_the_student_t_interval():
    # [1, 2, 3]: mean 2, sd 1, sem 1/sqrt(3); t(0.975, df=2) = 4.302653 -> half width 4.302653 / sqrt(3) = 2.484138
    estimate = mean_ci([1.0, 2.0, 3.0])
    assert estimate.mean == pytest.approx(2.0) and estimate.half_width == pytest.approx(2.484138, abs=1e-6)
    assert estimate.n == 3
    assert math.isnan(mean_ci([0.4]).half_width) and mean_ci([0.4]).mean == 0.4


def test_difference_is_paired_by_seed_or_welch():
    # paired: per-seed differences [0.1, 0.2, 0.0]: mean 0.1, sd 0.1 -> half width 4.302653 * 0.1 / sqrt(3) = 0.248414
    paired, how = difference_ci({0: 0.5, 1: 0.7, 2: 0.6}, {0: 0.4, 1: 0.5, 2: 0.6})
    assert how == "paired" and paired.mean == pytest.approx(0.1) and paired.half_width == pytest.approx(0.248414, abs=1e-6)
    # different seeds: Welch's interval, checked against scipy's own Welch test
    welch, how = difference_ci({0: 1.0, 1: 3.0, 2: 2.5}, {3: 2.0, 4: 6.0, 5: 5.0})
    low, high = stats.ttest_ind([1.0, 3.0, 2.5], [2.0, 6.0, 5.0], equal_var=False).confidence_interval(0.95)
    assert how == "welch" and welch.mean == pytest.approx((low + high) / 2)
    assert welch.half_width == pytest.approx((high - low) / 2)


def _make_run(root: Path, name: str, overrides: list[str], finals: list[float], status: str = "ok",
              extra_rows: list[dict] = (), span: tuple[float, float] | None = None, host: dict | None = None) -> Path:
    """A run dir as python -m prmppo writes it, with test accuracy `finals[i]` after i iterations (and
    `extra_rows` appended to metrics.jsonl); `span` = (started_at, finished_at) and `host` go to
    run_info.json and stage_result.json."""
    run_dir = root / name
    (run_dir / ".hydra").mkdir(parents=True)
    cfg = compose_config(overrides)
    OmegaConf.save(cfg, run_dir / ".hydra" / "config.yaml")
    OmegaConf.save(OmegaConf.create(overrides), run_dir / ".hydra" / "overrides.yaml")
    reward = next((o.split("=")[1] for o in overrides if o.startswith("reward=")), cfg.arm.name)
    OmegaConf.save({"hydra": {"runtime": {"choices": {"arm": cfg.arm.name, "reward": reward}}}},
                   run_dir / ".hydra" / "hydra.yaml")  # the group options Hydra records
    result = {"status": status, "arm": cfg.arm.name, "seed": cfg.seed}
    if span is not None:
        result["finished_at"] = span[1]
        (run_dir / "run_info.json").write_text(json.dumps({"started_at": span[0], **(host or {})}))
    if status == "failed":
        result["error"] = {"message": "invalid config: ppo.lr=0 must be > 0", "type": "ConfigError"}
    (run_dir / "stage_result.json").write_text(json.dumps(result))
    rows = [{"stage": "ppo_eval", "step": max(i - 1, 0), "eval/ppo_iterations": i, "eval/test_greedy_accuracy": acc,
             "eval/test_sampled_accuracy": acc / 2} for i, acc in enumerate(finals)]
    rows += [{"stage": "ppo", "step": i, "reward/total_mean": acc} for i, acc in enumerate(finals[1:])]
    rows += list(extra_rows)
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return run_dir


@pytest.fixture
def eta_sweep(tmp_path) -> Path:
    """arm=prm,orm x reward.eta=0.5,1.0 x seed=0,1, the PRM arm with the clip transform (eta live)."""
    for arm in ("prm", "orm"):
        for eta in ("0.5", "1.0"):
            for seed in (0, 1):
                extra = ["reward.transform=clip"] if arm == "prm" else []
                final = {"prm": 0.6 + 0.1 * (eta == "1.0"), "orm": 0.4 + 0.1 * (eta == "1.0")}[arm] + 0.05 * seed
                _make_run(tmp_path, f"{arm}-{eta}-{seed}", [f"arm={arm}", f"reward.eta={eta}", f"seed={seed}", *extra],
                          [0.3, 0.45, final])
    return tmp_path


def test_a_key_an_arm_never_reads_does_not_split_its_group(eta_sweep):
    grouping = group_runs(find_runs([eta_sweep]))
    assert grouping.keys == ["reward.eta", "reward.transform"]
    # the ORM arm ignores eta (and has no transform): one group of 4 runs over 2 seeds;
    # the PRM arm reads eta under clip: one group per eta value
    assert sorted(grouping.groups) == [("orm", "-", "-"), ("prm", "0.5", "clip"), ("prm", "1.0", "clip")]
    orm = next(row for row in group_rows(grouping, 0.5) if row.group[0] == "orm")
    assert orm.runs == 4 and orm.seeds == [0, 1]
    # runs that share a seed are one replicate: seed 0 = mean(0.40, 0.50), seed 1 = mean(0.45, 0.55)
    assert orm.greedy.mean == pytest.approx(0.475) and orm.greedy.n == 2
    diffs = {d.prm: d for d in difference_rows(grouping)}
    assert set(diffs) == {("prm", "0.5", "clip"), ("prm", "1.0", "clip")}
    # eta=1.0: PRM seeds (0.70, 0.75) vs ORM seeds (0.45, 0.50): paired differences 0.25, 0.25
    assert diffs[("prm", "1.0", "clip")].difference.mean == pytest.approx(0.25)
    assert diffs[("prm", "1.0", "clip")].pairing == "paired"


def test_iterations_to_threshold_is_the_first_evaluation_at_or_above_it(tmp_path):
    _make_run(tmp_path, "a", ["seed=0"], [0.3, 0.55, 0.5, 0.7])
    _make_run(tmp_path, "b", ["seed=1"], [0.3, 0.4, 0.45, 0.49])
    runs = find_runs([tmp_path])
    assert iterations_to(runs, "eval/test_greedy_accuracy", 0.5) == {0: 1, 1: None}


def test_failed_runs_are_listed_not_fatal(tmp_path):
    _make_run(tmp_path, "ok", ["seed=0"], [0.3, 0.5])
    _make_run(tmp_path, "bad", ["seed=1"], [], status="failed")
    report = write_report([tmp_path], tmp_path / "out")
    text = report.read_text()
    assert "## Runs that did not finish" in text and "ppo.lr=0 must be > 0" in text and "| failed |" in text
    assert (tmp_path / "out" / "accuracy.png").stat().st_size > 10_000


def test_bad_inputs_name_what_is_wrong(tmp_path):
    with pytest.raises(ReportError, match="does not exist"):
        find_runs([tmp_path / "absent"])
    (tmp_path / "empty").mkdir()
    with pytest.raises(ReportError, match="no runs under .*empty.*hydra/config.yaml"):
        find_runs([tmp_path / "empty"])
    run_dir = _make_run(tmp_path / "runs", "r", ["seed=0"], [0.3, 0.5, 0.6])
    metrics = run_dir / "metrics.jsonl"
    lines = metrics.read_text().splitlines()
    metrics.write_text("\n".join([lines[0], "{not json", *lines[1:]]) + "\n")
    with pytest.raises(ReportError, match=r"metrics.jsonl line 2 is not valid JSON"):
        find_runs([tmp_path / "runs"])
    metrics.write_text("\n".join(lines) + "\n" + '{"stage": "ppo_eval", "st')  # a kill mid-write: ignored
    (run,) = find_runs([tmp_path / "runs"])
    assert run.series("ppo_eval", "eval/test_greedy_accuracy", "eval/ppo_iterations") == {0: 0.3, 1: 0.5, 2: 0.6}
    (run_dir / "stage_result.json").write_text("{")
    with pytest.raises(ReportError, match="stage_result.json is not valid JSON"):
        find_runs([tmp_path / "runs"])


def _final_from_jsonl(run_dir: Path, key: str = "eval/test_greedy_accuracy") -> float:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in rows if r["stage"] == "ppo_eval"]
    return max(evals, key=lambda r: r["eval/ppo_iterations"])[key]


@pytest.mark.slow  # a real 4-job sweep (tiny_sweep)
def test_report_cli_on_a_tiny_multirun_writes_plots_and_table(tiny_sweep, tmp_path):
    out = tmp_path / "report"
    proc = subprocess.run([sys.executable, "-m", "prmppo.report", str(tiny_sweep), "--out", str(out)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    for name in ("accuracy.png", "rewards.png", "hacking.png"):
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and (out / name).stat().st_size > 10_000
    text = (out / "report.md").read_text()
    assert "| orm | ORM | 0,1 | 2 |" in text and "| prm | learned PRM | 0,1 | 2 |" in text
    assert "paired (n=2)" in text and "![accuracy.png](accuracy.png)" in text
    assert "| learned PRM - ORM | arm=prm | arm=orm | greedy |" in text and "| pass@" in text
    # the sweep's own record: Hydra's command line, sweep_result.json, and the runs' start/end times and host
    assert "python -m prmppo -m stage=ppo debug=smoke" in text and "arm=prm,orm seed=0,1" in text
    assert "- jobs: 4 ok (from sweep_result.json)" in text and "- hardware: " in text
    assert "wall time: not recorded" not in text and "hardware: not recorded" not in text
    # the table's numbers are the runs' own: mean of the last test evaluation in each metrics.jsonl
    grouping = group_runs(find_runs([tiny_sweep]))
    for row in group_rows(grouping, 0.5):
        runs = grouping.groups[row.group]
        greedy = [_final_from_jsonl(r.path) for r in runs]
        sampled = [_final_from_jsonl(r.path, "eval/test_sampled_accuracy") for r in runs]
        # the sweep's policies are right part of the time: a wrong column or run would show
        assert all(0 < value < 1 for value in greedy + sampled)
        assert row.greedy.mean == pytest.approx(sum(greedy) / len(runs))
        assert row.sampled.mean == pytest.approx(sum(sampled) / len(runs))
        assert all(len(r.series("ppo_eval", "eval/test_greedy_accuracy", "eval/ppo_iterations")) == 4 for r in runs)


def test_report_cli_refuses_a_dir_without_runs_in_one_line(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "prmppo.report", str(tmp_path)], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 2
    assert proc.stderr.strip().startswith("prmppo.report: error: no runs under") and len(proc.stderr.splitlines()) == 1


def test_a_reward_choice_belongs_to_the_arm_and_still_pairs_with_orm(tmp_path):
    # two separate sweeps read together: arm=prm reward=prm_oracle, and arm=orm
    for seed in (0, 1):
        _make_run(tmp_path / "oracle", f"p{seed}", ["arm=prm", "reward=prm_oracle", f"seed={seed}"], [0.3, 0.6 + seed / 10])
        _make_run(tmp_path / "orm", f"o{seed}", ["arm=orm", f"seed={seed}"], [0.3, 0.5 + seed / 10])
    grouping = group_runs(find_runs([tmp_path / "oracle", tmp_path / "orm"]))
    assert grouping.keys == ["reward"]
    assert sorted(grouping.groups) == [("orm", "orm"), ("prm", "prm_oracle")]
    (diff,) = difference_rows(grouping)
    assert diff.prm == ("prm", "prm_oracle") and diff.difference.mean == pytest.approx(0.1)


def test_pass_at_k_and_the_final_evaluation_are_columns_with_their_sources(tmp_path):
    # ppo_eval rows carry pass@4; the pipeline's final evaluation (`eval` rows) greedy, sampled, pass@2 and pass@8
    for seed, final in ((0, 0.5), (1, 0.7)):
        during = {"stage": "ppo_eval", "step": 1, "eval/ppo_iterations": 2, "eval/test_greedy_accuracy": final,
                  "eval/test_pass@4": final + 0.2}
        after = {"stage": "eval", "step": 0, "eval/ppo/greedy_accuracy": final - 0.1,
                 "eval/ppo/sampled_accuracy": final / 2, "eval/ppo/pass@2": 0.1, "eval/ppo/pass@8": final + 0.1,
                 "eval/sft/pass@8": 0.01}
        _make_run(tmp_path, f"r{seed}", [f"seed={seed}"], [0.3, 0.4], extra_rows=[during, after])
    grouping = group_runs(find_runs([tmp_path]))
    assert [m.name for m in measures(find_runs([tmp_path]))] == [
        "greedy", "sampled", "pass@4", "final greedy", "final sampled", "final pass@8", "SFT pass@8"]
    (row,) = group_rows(grouping, 0.5)
    # the largest pass@k, each from its own rows: pass@4 = mean(0.7, 0.9), final pass@8 = mean(0.6, 0.8)
    assert row.values["pass@4"].mean == pytest.approx(0.8) and row.values["final pass@8"].mean == pytest.approx(0.7)
    assert row.values["final greedy"].mean == pytest.approx(0.5) and row.greedy.mean == pytest.approx(0.6)
    text = write_report([tmp_path], tmp_path / "out").read_text()
    assert "| final greedy | final sampled | final pass@8 |" in text
    # the accuracy figure has a panel per accuracy logged during PPO, pass@4 included
    assert [ax.get_title() for ax in accuracy_figure(grouping).axes] == [
        "test accuracy (greedy)", "test accuracy (sampled)", "test accuracy (pass@4)"]
    assert "`ppo_eval` rows of metrics.jsonl" in text and "as in eval.json" in text
    assert "- `SFT ...`: the same final evaluation of the SFT policy" in text


def test_learned_and_oracle_prm_are_each_compared_with_orm_within_one_lambda(tmp_path):
    # three arms x GAE lambda 0.95 / 1.0 x 3 seeds, as two sweeps (arm=orm,prm and arm=prm reward=prm_oracle)
    base = {"orm": 0.40, "prm": 0.45, "prm_oracle": 0.60}
    arms = (("orm", ["arm=orm"]), ("prm", ["arm=prm"]), ("prm_oracle", ["arm=prm", "reward=prm_oracle"]))
    for name, overrides in arms:
        for lam in ("0.95", "1.0"):
            for seed in (0, 1, 2):
                final = base[name] + 0.1 * (lam == "1.0") + 0.02 * seed + 0.01 * seed * (name == "prm")
                _make_run(tmp_path / ("oracle" if "oracle" in name else "main"), f"{name}-{lam}-{seed}",
                          [*overrides, "ppo.advantage_estimator=gae", f"ppo.lam_actor={lam}", f"seed={seed}"],
                          [0.3, final])
    grouping = group_runs(find_runs([tmp_path]))
    assert grouping.keys == ["ppo.lam_actor", "reward"]
    diffs = {(d.label, d.prm[1]): d for d in difference_rows(grouping)}
    assert set(diffs) == {(kind, lam) for kind in ("learned PRM - ORM", "oracle PRM - ORM") for lam in ("0.95", "1.0")}
    for (label, lam), d in diffs.items():
        assert d.orm[1] == lam and d.pairing == "paired" and d.difference.n == 3  # never across lambdas
    # oracle - ORM: 0.20 on every seed -> no spread; learned - ORM: 0.05 + 0.01 * seed -> mean 0.06,
    # half width t(0.975, 2) * 0.01 / sqrt(3) = 0.024841
    assert diffs[("oracle PRM - ORM", "0.95")].difference.mean == pytest.approx(0.2)
    learned = diffs[("learned PRM - ORM", "1.0")]
    assert learned.difference.mean == pytest.approx(0.06)
    assert learned.difference.half_width == pytest.approx(0.024841, abs=1e-6)
    assert learned.excludes_zero()
    text = write_report([tmp_path], tmp_path / "out").read_text()
    # greedy and sampled, each for both lambdas
    assert text.count("| learned PRM - ORM |") == 4 and text.count("| oracle PRM - ORM |") == 4
    assert "| +0.060 | [+0.035, +0.085] | yes | paired (n=3) |" in text


def test_a_difference_whose_interval_contains_zero_is_not_claimed(tmp_path):
    for seed, (prm, orm) in enumerate(((0.5, 0.4), (0.4, 0.5), (0.55, 0.5))):
        sft = [{"stage": "eval", "step": 0, "eval/sft/greedy_accuracy": 0.3 + seed / 100}]  # the arms' shared start
        _make_run(tmp_path, f"p{seed}", ["arm=prm", f"seed={seed}"], [0.3, prm], extra_rows=sft)
        _make_run(tmp_path, f"o{seed}", ["arm=orm", f"seed={seed}"], [0.3, orm], extra_rows=sft)
    (diff,) = difference_rows(group_runs(find_runs([tmp_path])))
    assert diff.label == "learned PRM - ORM" and not diff.excludes_zero()
    text = write_report([tmp_path], tmp_path / "out").read_text()
    assert "| no | paired (n=3) |" in text
    # the SFT baseline is a column (0.31 on average) but never a PRM - ORM row
    assert "| SFT greedy |" in text and "| 0.310 ± " in text and "| SFT greedy | 0." not in text


def _multirun_record(sweep_dir: Path, task: list[str], hydra: list[str]) -> None:
    """Hydra's multirun.yaml as far as the report reads it: the overrides of the command line."""
    sweep_dir.mkdir(parents=True, exist_ok=True)
    OmegaConf.save({"hydra": {"overrides": {"task": task, "hydra": hydra}}}, sweep_dir / "multirun.yaml")


def test_each_sweep_has_its_command_statuses_wall_time_and_hardware(tmp_path):
    sweep = tmp_path / "sweep"
    _multirun_record(sweep, ["arm=orm", "seed=0,1", "task.rl.max_operands=6"],
                     ["hydra.mode=MULTIRUN", "hydra.sweep.dir=multirun/a b", "hydra.sweep.subdir=${hydra.job.num}"])
    host = {"hostname": "gpubox", "device": "NVIDIA H200", "cpu_count": 16}
    # two jobs at once: 100-160 s and 110-220 s -> wall 120 s, job time 60 + 110 = 170 s
    _make_run(sweep, "0", ["arm=orm", "seed=0", "task.rl.max_operands=6"], [0.3, 0.5], span=(100.0, 160.0), host=host)
    _make_run(sweep, "1", ["arm=orm", "seed=1", "task.rl.max_operands=6"], [0.3, 0.5], span=(110.0, 220.0), host=host)
    (sweep / "sweep_result.json").write_text(json.dumps({"jobs": [{"status": "ok"}, {"status": "ok"},
                                                                  {"status": "failed"}]}))
    _make_run(tmp_path, "single", ["arm=orm", "seed=2"], [0.3, 0.4])  # no run_info.json: times not recorded
    sweeps = find_sweeps(find_runs([tmp_path]))
    assert [s.path for s in sweeps] == [tmp_path / "single", sweep]
    single, multi = sweeps
    assert multi.command == ("python -m prmppo -m arm=orm seed=0,1 task.rl.max_operands=6 'hydra.sweep.dir=multirun/a b' "
                             "'hydra.sweep.subdir=${hydra.job.num}'")  # as typed, not resolved
    assert single.command == "python -m prmppo arm=orm seed=2"
    assert multi.wall_seconds() == 120.0 and multi.job_seconds() == 170.0 and single.wall_seconds() is None
    assert dict(multi.statuses) == {"ok": 2, "failed": 1} and multi.hardware() == ["gpubox: NVIDIA H200, 16 CPUs"]
    text = "\n".join(sweeps_section(sweeps))
    assert "- wall time: 2m 00s; job time: 2m 50s" in text and "- jobs: 1 failed, 2 ok (from sweep_result.json)" in text
    assert "- wall time: not recorded" in text and "- hardware: not recorded" in text
    (sweep / "multirun.yaml").write_text("hydra: [")
    with pytest.raises(ReportError, match="multirun.yaml cannot be read"):
        find_sweeps(find_runs([tmp_path]))


def test_a_run_records_its_start_host_and_end(tmp_path):
    from prmppo.stages.common import record_start, write_stage_result

    record_start(tmp_path, "cpu")
    info = json.loads((tmp_path / "run_info.json").read_text())
    assert info["device"] == "cpu" and info["cpu_count"] >= 1 and info["hostname"] and info["started_at"] > 1.7e9
    record_start(tmp_path, "cpu")  # a relaunch keeps the first start
    assert json.loads((tmp_path / "run_info.json").read_text()) == info
    write_stage_result(tmp_path, compose_config(["arm=orm"]), "ppo", {})
    assert json.loads((tmp_path / "stage_result.json").read_text())["finished_at"] >= info["started_at"]


def test_a_sweep_names_the_code_its_runs_ran_and_their_cpu(tmp_path):
    versions = {"python": "3.11.7", "torch": "2.13.0+cpu", "transformers": "5.24.0", "peft": "0.21.2",
                "hydra-core": "1.3.8", "omegaconf": "2.3.1"}
    machine = {"hostname": "box", "device": "cpu", "cpu_count": 2, "cpu_model": "AMD EPYC", "versions": versions}
    sweep = tmp_path / "sweep"
    _multirun_record(sweep, ["arm=orm", "seed=0,1"], [])
    _make_run(sweep, "0", ["arm=orm", "seed=0"], [0.3], span=(1.0, 2.0),
              host={**machine, "code": {"commit": "a" * 40, "dirty": False}})
    _make_run(sweep, "1", ["arm=orm", "seed=1"], [0.3], span=(1.0, 2.0),
              host={**machine, "code": {"commit": "b" * 40, "dirty": True}})
    _make_run(tmp_path, "wheel", ["arm=orm", "seed=2"], [0.3], span=(1.0, 2.0), host={**machine, "code": None})
    _make_run(tmp_path, "old", ["arm=orm", "seed=3"], [0.3], span=(1.0, 2.0), host={"hostname": "box"})
    old, multi, wheel = find_sweeps(find_runs([tmp_path]))
    assert multi.hardware() == ["box: cpu, 2 CPUs (AMD EPYC)"]
    shown = "python 3.11.7, torch 2.13.0+cpu, transformers 5.24.0, peft 0.21.2, hydra-core 1.3.8"
    assert multi.code() == [f"`aaaaaaaaaaaa`; {shown}", f"`bbbbbbbbbbbb` + uncommitted changes; {shown}"]
    assert wheel.code() == [f"not a git checkout; {shown}"] and old.code() == []
    text = "\n".join(sweeps_section([old, multi, wheel]))
    assert f"- code, 2 versions:\n  - `aaaaaaaaaaaa`; {shown}\n  - `bbbbbbbbbbbb` + uncommitted changes" in text
    assert f"- code: not a git checkout; {shown}" in text and "- code: not recorded" in text


def _hack_rows(gaps: list[float], score: float, repeated: float) -> list[dict]:
    return [{"stage": "ppo", "step": i, "prm/score_mean": score, "hack/true_step_accuracy": score - gap,
             "hack/prm_vs_true_step_gap": gap, "hack/steps_per_response": 4.0 + i, "hack/repeated_line_rate": repeated}
            for i, gap in enumerate(gaps)]


def test_hacking_table_reports_late_monitors_and_when_the_gap_opens(tmp_path):
    # transform plain: the gap opens after 3 iterations on seed 0 and never on seed 1; delta: never
    _make_run(tmp_path, "p0", ["arm=prm", "seed=0"], [0.3], extra_rows=_hack_rows([0.0, 0.05, 0.3, 0.4], 0.9, 0.2))
    _make_run(tmp_path, "p1", ["arm=prm", "seed=1"], [0.3], extra_rows=_hack_rows([0.0, 0.0, 0.1, 0.1], 0.7, 0.4))
    _make_run(tmp_path, "d0", ["arm=prm", "reward.transform=delta", "seed=0"], [0.3],
              extra_rows=_hack_rows([0.0] * 4, 0.6, 0.0))
    _make_run(tmp_path, "o0", ["arm=orm", "seed=0"], [0.3])  # no PRM monitors: not in the table
    grouping = group_runs(find_runs([tmp_path]))
    plain = grouping.groups[("prm", "plain")]
    assert first_gap(plain, 0.1) == {0: 3, 1: None}  # iterations done; 0.1 itself is not above 0.1
    # steps per response 4, 5, 6, 7 by iteration: the last 2 average 6.5
    assert late_means(plain, "hack/steps_per_response", 2) == {0: 6.5, 1: 6.5}
    assert late_means(plain, "hack/prm_vs_true_step_gap", 2) == {0: pytest.approx(0.35), 1: pytest.approx(0.1)}
    # the gap at the start (first 2 iterations: 0.025 and 0) and how far it opened since
    assert early_means(plain, "hack/prm_vs_true_step_gap", 2) == {0: pytest.approx(0.025), 1: pytest.approx(0.0)}
    assert gap_change(plain, 2) == {0: pytest.approx(0.325), 1: pytest.approx(0.1)}
    lines = hacking_section(grouping, gap_threshold=0.1, window=2)
    text = "\n".join(lines)
    assert "first iteration with gap > 0.1" in text and "3 (1/2 seeds); s0: 3, s1: never" in text
    assert "never (0/1); s0: never" in text and "arm=orm" not in text
    # gap column: seeds 0.35 and 0.1 -> mean 0.225 +- t(0.975, 1) * 0.125 = 1.588
    assert "| 0.225 ± 1.588 |" in text
    header = next(line for line in lines if line.startswith("| group"))
    assert "| gap, first 2 it. | gap, last 2 it. | gap change |" in header
    row = next(line for line in lines if line.startswith("| arm=prm reward.transform=plain"))
    # first-window gap 0.0125 +- 12.706 * 0.0125; change (0.325 + 0.1) / 2 = 0.2125 +- 12.706 * 0.1125
    assert "| 0.013 ± 0.159 | 0.225 ± 1.588 | 0.212 ± 1.429 |" in row
    assert "## Reward hacking" not in write_report([tmp_path / "o0"], tmp_path / "out").read_text()
    # the hacking figure draws the PRM's score beside the true step accuracy
    titles = [ax.get_title() for ax in metrics_figure(grouping, HACK_METRICS, "hacking").axes if ax.get_visible()]
    assert titles[:3] == ["prm/score_mean", "hack/true_step_accuracy", "hack/prm_vs_true_step_gap"]


def test_report_cli_writes_the_named_file_and_refuses_a_bad_name(tmp_path, capsys):
    _make_run(tmp_path / "runs", "r", ["seed=0"], [0.3, 0.5])
    assert report_main([str(tmp_path / "runs"), "--out", str(tmp_path / "exp"), "--name", "RESULTS.md",
                        "--gap-threshold", "0.2"]) == 0
    assert (tmp_path / "exp" / "RESULTS.md").read_text().startswith("# prmppo report")
    assert report_main([str(tmp_path / "runs"), "--out", str(tmp_path / "exp"), "--name", "../x.md"]) == 2
    assert "file name must be a plain *.md name" in capsys.readouterr().err


def test_a_run_whose_reward_cannot_be_built_is_named(tmp_path):
    run_dir = _make_run(tmp_path, "r", ["arm=prm", "seed=0"], [0.3, 0.5])
    config = OmegaConf.load(run_dir / ".hydra" / "config.yaml")
    config.reward.transform = "squared"  # e.g. a run made by a version with a transform this one lacks
    OmegaConf.save(config, run_dir / ".hydra" / "config.yaml")
    with pytest.raises(ReportError, match=r"r/.hydra/config.yaml: its reward cannot be built .*transform='squared'"):
        find_runs([tmp_path])


@pytest.mark.slow  # a whole smoke pipeline
def test_a_pipeline_run_is_read_with_the_final_evaluation_eval_json_holds(smoke_cfg):
    from prmppo.app import run

    cfg = smoke_cfg("arm=orm")
    run(cfg)
    run_dir = Path(cfg.run_dir)
    (run_dir / ".hydra").mkdir()
    OmegaConf.save(cfg, run_dir / ".hydra" / "config.yaml")  # what Hydra would have written
    final = json.loads((run_dir / "eval.json").read_text())["ppo"]
    (row,) = group_rows(group_runs(find_runs([run_dir])), 0.5)
    # smoke: eval.k=2 for the final evaluation, eval.during_ppo_k=2 during PPO
    assert set(row.values) == {"greedy", "sampled", "pass@2", "final greedy", "final sampled", "final pass@2",
                               "SFT greedy", "SFT sampled", "SFT pass@2"}
    sft = json.loads((run_dir / "eval.json").read_text())["sft"]
    assert row.values["SFT greedy"].mean == sft["greedy_accuracy"] and row.values["SFT pass@2"].mean == sft["pass@2"]
    assert row.values["final pass@2"].mean == final["pass@2"]
    assert row.values["final greedy"].mean == final["greedy_accuracy"]
    assert row.values["final sampled"].mean == final["sampled_accuracy"]
    (sweep,) = find_sweeps(find_runs([run_dir]))
    assert sweep.wall_seconds() > 0 and f": cpu, {os.cpu_count()} CPUs" in sweep.hardware()[0]


def test_an_estimator_is_compared_only_with_itself(tmp_path):
    # rloo (the default, not typed) beside GAE at lambda 0.95: lam_actor is inert for rloo, which must not
    # let an rloo group match a GAE group
    for arm in ("orm", "prm"):
        for seed in (0, 1):
            _make_run(tmp_path / "rloo", f"{arm}{seed}", [f"arm={arm}", f"seed={seed}"], [0.3, 0.5])
            _make_run(tmp_path / "gae", f"{arm}{seed}", [f"arm={arm}", "ppo.advantage_estimator=gae",
                                                         "ppo.lam_actor=0.95", f"seed={seed}"], [0.3, 0.4])
    grouping = group_runs(find_runs([tmp_path]))
    assert grouping.keys == ["ppo.advantage_estimator", "ppo.lam_actor"]
    pairs = sorted((d.prm[1:], d.orm[1:]) for d in difference_rows(grouping))
    assert pairs == [(("gae", "0.95"), ("gae", "0.95")), (("rloo", "-"), ("rloo", "-"))]
