"""The markdown of a pre-registered study's results, section by section; every number at a fixed precision and
every list in a fixed order, so the same archive gives the same text."""

from __future__ import annotations

import math
from collections import defaultdict

from prmppo.report.markdown import table
from prmppo.report.prereg.endpoints import Result
from prmppo.report.prereg.study import Study, problem_value
from prmppo.report.runs import NOT_GROUPING
from prmppo.report.stats import mean_ci

P_FLOOR = 1e-4  # p values below it are shown as "<0.0001"


def num(x: float | None) -> str:
    return "n/a" if x is None or math.isnan(x) else f"{x:.3f}"


def signed(x: float) -> str:
    return "n/a" if math.isnan(x) else f"{x:+.3f}"


def pval(p: float) -> str:
    return "n/a" if math.isnan(p) else "<0.0001" if p < P_FLOOR else f"{p:.4f}"


def interval(low: float, high: float) -> str:
    return "n/a" if math.isnan(low) else f"[{low:+.3f}, {high:+.3f}]"


def seed_text(seeds) -> str:
    """Sorted seeds as ranges: [0, 1, 2, 5] -> `0-2, 5`; none -> `none`."""
    seeds, parts = sorted(seeds), []
    for seed in seeds:
        if parts and seed == parts[-1][1] + 1:
            parts[-1][1] = seed
        else:
            parts.append([seed, seed])
    return ", ".join(f"{a}-{b}" if a != b else f"{a}" for a, b in parts) or "none"


def result_rows(results: list[Result], margin: float) -> tuple[list[str], list[list[str]]]:
    """The endpoint table's header and rows (the arm against the other, paired by seed)."""
    arm, against = results[0].arm, results[0].against
    header = ["endpoint", "measure", against, arm, f"{arm} - {against}", "95% t CI", "95% prompt x seed bootstrap CI",
              "paired t p", "Holm p", f"TOST p (±{margin:g})", "verdict", "seeds"]
    rows = []
    for r in results:
        boot = "-" if r.bootstrap is None else interval(r.bootstrap.low, r.bootstrap.high) + (
            f" (n={r.bootstrap.n})" if r.bootstrap.n != len(r.per_seed) else "")
        rows.append([r.endpoint.id, r.endpoint.label, num(r.mean(1)), num(r.mean(0)), signed(r.t.mean),
                     interval(r.t.low, r.t.high), boot, pval(r.p), pval(r.p_holm), pval(r.equivalence.p), r.verdict,
                     str(len(r.per_seed))])
    return header, rows


def endpoints_table(results: list[Result], margin: float) -> list[str]:
    return table(*result_rows(results, margin))


def last_evaluations(study: Study, arm: str, seeds) -> str:
    """`after N iterations (seeds ...)` for each last evaluated iteration count of the arm's runs over `seeds`."""
    by_last: dict[int, list[int]] = defaultdict(list)
    for seed, record in sorted(study.ppo.get(arm, {}).items()):
        if seed in seeds and (curve := record.curve("greedy")):
            by_last[max(curve)].append(seed)
    return "; ".join(f"after {n} iterations (seeds {seed_text(s)})" for n, s in sorted(by_last.items())) or "none"


def per_seed_section(results: list[Result], seeds) -> list[str]:
    """Appendix: each seed's value of every primary endpoint in both arms and their difference."""
    arm, against = results[0].arm, results[0].against
    body = []
    for seed in seeds:
        cells = []
        for r in results:
            pair = r.per_seed.get(seed)
            cells.append("missing" if pair is None else f"{pair[1]:.3f} / {pair[0]:.3f} / {pair[0] - pair[1]:+.3f}")
        body.append([str(seed), *cells])
    return ["## Appendix: primary endpoints per seed", "",
            f"Each cell: {against} / {arm} / {arm} - {against}.", "",
            *table(["seed", *(r.endpoint.id for r in results)], body)]


def runs_section(study: Study, roles: dict[str, list[str]]) -> list[str]:
    """Each arm: what it was (its reward kind, the overrides common to its runs but seeds and locations, which
    differ between machines), the seeds read and missing; and the code the runs ran."""
    body = []
    for arm in study.spec.arms():
        runs = study.ppo.get(arm, {})
        kinds = sorted({r.run.reward_kind for r in runs.values()})
        common = set.intersection(*(set(r.run.overrides.items()) for r in runs.values())) if runs else set()
        typed = " ".join(f"`{k}={v}`" for k, v in sorted(common)
                         if k not in NOT_GROUPING and not k.startswith("hydra."))
        wanted = study.spec.seeds_of(arm)
        body.append([f"`{arm}`", ", ".join(roles[arm]), ", ".join(kinds) or "n/a", typed or "-", seed_text(runs),
                     seed_text(set(wanted) - set(runs))])
    codes = defaultdict(int)
    for runs in study.ppo.values():
        for r in runs.values():
            codes[r.code] += 1
    return ["## Runs", "", *table(["arm", "role", "reward kind", "overrides typed (all its runs)", "seeds read",
                                   "seeds missing"], body), "", "The code the PPO runs ran (run_info.json):", "",
            *(f"- {code}: {n} run{'' if n == 1 else 's'}" for code, n in sorted(codes.items()))]


def _pooled(rows: list[dict]) -> dict[str, tuple[int, list[float]]]:
    """`{group: (problems x seeds, [greedy, sampled, pass@k])}`, groups `all` and `<key>=<value>` of the
    problems' difficulty, pooled over every (seed, problem) row."""
    groups: dict[str, list[dict]] = defaultdict(list)
    for row in rows:
        groups["all"].append(row)
        for key, value in (row.get("difficulty") or {}).items():
            groups[f"{key}={value}"].append(row)
    return {g: (len(rs), [sum(problem_value(r, m) for r in rs) / len(rs) for m in ("greedy", "sampled", "pass")])
            for g, rs in groups.items()}


def _rows(record, policy: str) -> list[dict]:
    """The per-problem outcomes of the final evaluation of `policy` (sft, ppo) in the run's eval.json."""
    return ((record.final or {}).get(policy) or {}).get("problems") or []


def _group_order(name: str):
    key, _, value = name.partition("=")
    return (name != "all", key, int(value) if value.lstrip("-").isdigit() else math.inf, value)


def difficulty_section(study: Study) -> list[str]:
    """EXPLORATORY: accuracy per difficulty of the SFT policy and of each arm's final policy (eval.json)."""
    spec = study.spec
    policies = []  # (label, seeds, pooled)
    for label, arm, policy in (("SFT", spec.baseline, "sft"), *((f"`{a}`", a, "ppo") for a in spec.arms())):
        runs = {s: r for s, r in study.ppo.get(arm, {}).items() if _rows(r, policy)}
        if runs:
            policies.append((label, runs, _pooled([p for r in runs.values() for p in _rows(r, policy)])))
    if not policies:
        return ["## Accuracy per difficulty (EXPLORATORY)", "", "No run has an eval.json."]
    groups = sorted({g for _, _, pooled in policies for g in pooled}, key=_group_order)
    ks = sorted({p["k"] for _, runs, _ in policies for r in runs.values() for p in _rows(r, "ppo") if "k" in p})
    names = ("greedy", "sampled", f"pass@{ks[0]}" if len(ks) == 1 else "pass@k")
    lines = ["## Accuracy per difficulty (EXPLORATORY)", "",
             "From each run's eval.json (the final evaluation after PPO, and of the SFT policy it started from, "
             f"taken from the `{spec.baseline}` runs), pooled over problems x seeds. `carries`: carrying steps of the "
             "true solution; `operands`: the prompt's operand count. Not part of the pre-registered answer."]
    count_rows = [[label, seed_text(runs), *(str(pooled[g][0]) if g in pooled else "0" for g in groups)]
                  for label, runs, pooled in policies]
    lines += ["", "Problems x seeds per group:", "", *table(["policy", "seeds", *groups], count_rows)]
    for index, name in enumerate(names):
        body = [[label, seed_text(runs), *(num(pooled[g][1][index]) if g in pooled else "n/a" for g in groups)]
                for label, runs, pooled in policies]
        lines += ["", f"{name}:", "", *table(["policy", "seeds", *groups], body)]
    return lines


PRM_COLUMNS = (("step accuracy", "step_accuracy"), ("on right steps", "step_accuracy_right_steps"),
               ("on wrong steps", "step_accuracy_wrong_steps"), ("first-error F1", "first_error_f1"),
               ("best-of-N, min", "bon/min_accuracy"), ("best-of-N, product", "bon/product_accuracy"),
               ("best-of-N, mean", "bon/mean_accuracy"), ("best-of-N, last", "bon/last_accuracy"),
               ("majority vote", "bon/majority_accuracy"), ("any of N right", "bon/oracle_accuracy"))


def prm_quality_section(study: Study) -> list[str]:
    """Each PRM's evaluation by its stage (held-out solutions, best-of-N), mean ± 95% t half-width over seeds;
    then the PRM arms' monitors during PPO."""
    during = during_ppo_section(study)
    if not study.spec.prm_quality:
        return ["## PRM quality", "", *during] if during else []
    body = []
    for q in study.spec.prm_quality:
        evals = study.prm.get(q.id, {})
        sizes = sorted({int(e["bon/best_of_n"]) for e in evals.values() if "bon/best_of_n" in e})
        cells = []
        for _, key in PRM_COLUMNS:
            values = [e[key] for _, e in sorted(evals.items()) if isinstance(e.get(key), (int, float))]
            cells.append(str(mean_ci(values)) if values else "n/a")
        body.append([f"`{q.id}`", q.label, seed_text(evals), ", ".join(map(str, sizes)) or "n/a", *cells])
    return ["## PRM quality", "",
            "Each PRM's evaluation by the PRM stage (`stage_result.json` summary `eval`): step accuracy (threshold "
            "0.5) on held-out test solutions, half of them corrupted, up to the first error; first-error-step F1; "
            "and best-of-N reranking of N samples of the SFT policy per test problem by the PRM's step scores "
            "(aggregated by min, product, mean or the last step) against majority vote over the N answers. "
            "Mean ± 95% t half-width over seeds.", "",
            *table(["PRM", "what", "seeds", "N", *(name for name, _ in PRM_COLUMNS)], body), *([""] + during if during
                                                                                            else [])]


DURING_PPO = (("PRM mean step score", "prm/score_mean"), ("true step accuracy", "hack/true_step_accuracy"),
              ("label flips", "prm/flipped_fraction"))


def during_ppo_section(study: Study) -> list[str]:
    """Per arm that scores steps: its monitors averaged over all PPO iterations of a run, then mean ± 95% t
    half-width over seeds; for an oracle arm its step verdicts' accuracy against the checker, 1 - flips."""
    body = []
    for arm in study.spec.arms():
        runs = study.ppo.get(arm, {})
        means = {metric: [sum(c.values()) / len(c) for _, r in sorted(runs.items())
                          if (c := r.run.series("ppo", metric))] for _, metric in DURING_PPO}
        if not means["prm/score_mean"]:
            continue
        oracle = {r.run.reward_kind for r in runs.values()} == {"oracle PRM"} and means["prm/flipped_fraction"]
        cells = [str(mean_ci(v)) if v else "n/a" for v in means.values()]
        flips = str(mean_ci([1 - f for f in means["prm/flipped_fraction"]])) if oracle else "-"
        body.append([f"`{arm}`", ", ".join(sorted({r.run.reward_kind for r in runs.values()})), seed_text(runs),
                     *cells, flips])
    if not body:
        return []
    return ["The PRM arms during PPO (`ppo` rows): each monitor averaged over a run's iterations, then mean ± 95% t "
            "half-width over seeds. Label flips: the fraction of step scores a noisy oracle flipped "
            "(`reward.label_noise`); its step accuracy against the checker is 1 - that.", "",
            *table(["arm", "reward kind", "seeds", *(name for name, _ in DURING_PPO), "oracle step accuracy"], body)]


def missing_section(study: Study) -> list[str]:
    lines = ["## Missing runs", ""]
    if study.missing:
        lines += ["Runs the study file names that are absent, did not finish, or lack an evaluation an endpoint "
                  "reads; their seeds drop out of what needs them (a run that failed twice is reported here, not "
                  "replaced).", "", *table(["run", "why"], [[f"`{m.name}`", m.why] for m in study.missing])]
    else:
        lines.append("None: every run the study file names is in the archive, finished, with every evaluation read.")
    if study.unexpected:
        lines += ["", "In the archive but not named by the study file (not analysed): "
                  + ", ".join(f"`{name}`" for name in study.unexpected) + "."]
    return lines
