"""`write_report(paths, out_dir)`: the figures as PNG and the markdown report beside them."""

from __future__ import annotations

from pathlib import Path

from prmppo.report.hacking import GAP_THRESHOLD, hacking_section
from prmppo.report.markdown import markdown
from prmppo.report.plots import HACK_METRICS, REWARD_METRICS, accuracy_figure, metrics_figure, save
from prmppo.report.runs import ReportError, find_runs, group_runs
from prmppo.report.sweeps import find_sweeps, sweeps_section
from prmppo.report.tables import group_rows


def write_report(paths: list[str | Path], out_dir: str | Path, threshold: float = 0.5, name: str = "report.md",
                 gap_threshold: float = GAP_THRESHOLD) -> Path:
    """Read every run under `paths`, write `accuracy.png`, `rewards.png`, `hacking.png` (those with data) and the
    markdown report `name` into `out_dir` (with the hacking table when PRM monitors were logged, and each
    sweep's command, runtime and hardware); returns the markdown's path."""
    if Path(name).name != name or not name.endswith(".md"):
        raise ReportError(f"the report's file name must be a plain *.md name, got {name!r}")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    runs = find_runs(paths)
    grouping = group_runs(runs)
    figures = []
    if group_rows(grouping, threshold):  # some finished run logged test accuracy
        figures.append(save(accuracy_figure(grouping), out_dir / "accuracy.png").name)
        for file, metrics, title in (("rewards.png", REWARD_METRICS, "Reward components and KL per iteration"),
                                     ("hacking.png", HACK_METRICS, "Reward-hacking monitors per iteration")):
            fig = metrics_figure(grouping, metrics, title)
            if fig is not None:
                figures.append(save(fig, out_dir / file).name)
    sections = [hacking_section(grouping, gap_threshold), sweeps_section(find_sweeps(runs))]
    report = out_dir / name
    report.write_text(markdown(grouping, threshold, figures, [str(p) for p in paths], sections))
    return report
