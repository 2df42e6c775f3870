"""The report as markdown: final accuracy per group, PRM - ORM differences, and the sections that have data
(reward hacking, the sweeps' commands and runtimes, runs that did not finish, the figures)."""

from __future__ import annotations

from prmppo.report.runs import INERT, Grouping
from prmppo.report.tables import SOURCES, GroupRow, compared, difference_rows, group_rows, measures


def reached(values: dict[int, int | None]) -> str:
    hit = sorted(v for v in values.values() if v is not None)
    if not hit:
        return f"never (0/{len(values)})"
    median = hit[len(hit) // 2] if len(hit) % 2 else (hit[len(hit) // 2 - 1] + hit[len(hit) // 2]) / 2
    return f"{median:g} ({len(hit)}/{len(values)} seeds)"


def table(header: list[str], rows: list[list[str]]) -> list[str]:
    cell = lambda value: str(value).replace("|", "/")  # noqa: E731  a `|` would split the cell
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)] + \
        ["| " + " | ".join(map(cell, row)) + " |" for row in rows]


def accuracy_section(grouping: Grouping, rows: list[GroupRow], threshold: float) -> list[str]:
    runs = [run for group in grouping.groups.values() for run in group]
    columns = [m.name for m in measures(runs)]
    lines = ["## Final test accuracy", ""]
    if not rows:
        return lines + ["No finished run logged test accuracy (`ppo_eval` rows need `eval.every` > 0; `eval` rows "
                        "come from the pipeline's final evaluation)."]
    header = ["arm", "reward kind", *grouping.keys, "seeds", "runs", *columns,
              f"iterations to greedy >= {threshold:g}"]
    body = [[row.group[0], row.kind, *row.group[1:], ",".join(map(str, row.seeds)), row.runs,
             *(row.values[name] for name in columns), reached(row.to_threshold)] for row in rows]
    lines += table(header, body)
    lines += ["", "Mean ± 95% Student-t half-width across seeds. Where the columns come from:"]
    shown = measures(runs)
    lines += [f"- {'`' + label.strip() + ' ...`' if label else 'greedy, sampled, pass@k'}: {text}"
              for stage, prefix, _, label, text in SOURCES
              if any(m.stage == stage and m.metric.startswith(prefix) for m in shown)]
    return lines


def differences_section(grouping: Grouping) -> list[str]:
    """PRM - ORM (learned and oracle) for every accuracy measure, paired by seed where the seeds match."""
    runs = [run for group in grouping.groups.values() for run in group]
    diffs = [d for measure in compared(runs) for d in difference_rows(grouping, measure)]
    if not diffs:
        return []
    diffs.sort(key=lambda d: (d.label, d.prm, d.orm))
    body = [[d.label, grouping.label(d.prm), grouping.label(d.orm), d.measure, f"{d.prm_mean:.3f}",
             f"{d.orm_mean:.3f}", f"{d.difference.mean:+.3f}", d.interval(), "yes" if d.excludes_zero() else "no",
             f"{d.pairing} (n={d.difference.n})"] for d in diffs]
    return ["## PRM - ORM", "",
            "Each PRM group against the ORM group with the same values of the swept keys (an estimator or "
            "`ppo.lam_actor` is compared only with itself). A difference whose 95% interval contains 0 is not "
            "shown to exist.", "",
            *table(["comparison", "PRM group", "ORM group", "measure", "PRM", "ORM", "difference", "95% CI",
                     "CI excludes 0", "pairing"], body)]


def not_finished_section(grouping: Grouping) -> list[str]:
    if not grouping.not_ok:
        return []
    body = [[f"`{run.path}`", run.status, (run.error or "").splitlines()[0] if run.error else ""]
            for run in grouping.not_ok]
    return ["## Runs that did not finish", "", *table(["run", "status", "error"], body)]


def markdown(grouping: Grouping, threshold: float, figures: list[str], sources: list[str],
             extra_sections: list[list[str]] = ()) -> str:
    """The report: groups, final accuracy with 95% CIs, PRM - ORM, `extra_sections` (e.g. hacking, sweeps),
    the runs that did not finish, and the figures."""
    keys = grouping.keys
    total = sum(len(r) for r in grouping.groups.values()) + len(grouping.not_ok)
    intro = (f"{total} runs from {', '.join(f'`{s}`' for s in sources)}; grouped by arm"
             + (f" and the swept keys {', '.join(f'`{k}`' for k in keys)}" if keys else "")
             + f"; seeds are the replicates. `{INERT}`: the key has no effect on that arm's runs "
               "(not split on). Intervals: 95% Student-t across seeds.")
    sections = [accuracy_section(grouping, group_rows(grouping, threshold), threshold),
                differences_section(grouping), *extra_sections, not_finished_section(grouping)]
    lines = ["# prmppo report", "", intro]
    for section in sections:
        if section:
            lines += ["", *section]
    for figure in figures:
        lines += ["", f"![{figure}]({figure})"]
    return "\n".join(lines) + "\n"
