"""`write_report(paths, out_dir)`: the figures as PNG and the markdown report beside them.

The same inputs give the same markdown, byte for byte: runs, groups and sweeps in sorted order, floats
at fixed precision, no dates or machine paths of its own (directories are named as given; an archive by
its file name, and a run read from one `<archive's file name>:<member dir>`). The PNGs carry no software
or date metadata.
"""

from __future__ import annotations

from pathlib import Path

from prmppo.report.archive import opened, source_name
from prmppo.report.hacking import GAP_THRESHOLD, hacking_section
from prmppo.report.markdown import markdown
from prmppo.report.plots import HACK_METRICS, REWARD_METRICS, accuracy_figure, metrics_figure, save
from prmppo.report.runs import ReportError, find_runs, group_runs
from prmppo.report.sweeps import find_sweeps, sweeps_section
from prmppo.report.tables import group_rows


def write_report(paths: list[str | Path], out_dir: str | Path, threshold: float = 0.5, name: str = "report.md",
                 gap_threshold: float = GAP_THRESHOLD) -> Path:
    """Read every run under `paths` (directories, or `*.tar.xz` archives of runs made by `python -m
    prmppo.report.archive`), write `accuracy.png`, `rewards.png`, `hacking.png` (those with data) and the markdown
    report `name` into `out_dir` (with the hacking table when PRM monitors were logged, and each sweep's command,
    runtime, hardware and code); returns the markdown's path."""
    if Path(name).name != name or not name.endswith(".md"):
        raise ReportError(f"the report's file name must be a plain *.md name, got {name!r}")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    with opened(paths) as (local, shown):
        runs = find_runs(local)
        sweeps = find_sweeps(runs)  # reads the sweep directories: before the runs are renamed for display
        for item in (*runs, *sweeps):
            item.path = Path(shown(item.path))
    grouping = group_runs(runs)
    figures = []
    if group_rows(grouping, threshold):  # some finished run logged test accuracy
        figures.append(save(accuracy_figure(grouping), out_dir / "accuracy.png").name)
        for file, metrics, title in (("rewards.png", REWARD_METRICS, "Reward components and KL per iteration"),
                                     ("hacking.png", HACK_METRICS, "Reward-hacking monitors per iteration")):
            fig = metrics_figure(grouping, metrics, title)
            if fig is not None:
                figures.append(save(fig, out_dir / file).name)
    sections = [hacking_section(grouping, gap_threshold), sweeps_section(sweeps)]
    report = out_dir / name
    report.write_text(markdown(grouping, threshold, figures, [source_name(p) for p in paths], sections))
    return report
