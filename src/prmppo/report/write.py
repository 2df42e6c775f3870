"""`write_report(paths, out_dir)`: the figures as PNG and `report.md` beside them."""

from __future__ import annotations

from pathlib import Path

from prmppo.report.plots import HACK_METRICS, REWARD_METRICS, accuracy_figure, metrics_figure, save
from prmppo.report.runs import find_runs, group_runs
from prmppo.report.markdown import markdown
from prmppo.report.tables import group_rows


def write_report(paths: list[str | Path], out_dir: str | Path, threshold: float = 0.5) -> Path:
    """Read every run under `paths`, write `accuracy.png`, `rewards.png`, `hacking.png` (those with data)
    and `report.md` into `out_dir`; returns the markdown's path."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    grouping = group_runs(find_runs(paths))
    figures = []
    if group_rows(grouping, threshold):  # some finished run logged test accuracy during PPO
        figures.append(save(accuracy_figure(grouping), out_dir / "accuracy.png").name)
        for name, metrics, title in (("rewards.png", REWARD_METRICS, "Reward components and KL per iteration"),
                                     ("hacking.png", HACK_METRICS, "Reward-hacking monitors per iteration")):
            fig = metrics_figure(grouping, metrics, title)
            if fig is not None:
                figures.append(save(fig, out_dir / name).name)
    report = out_dir / "report.md"
    report.write_text(markdown(grouping, threshold, figures, [str(p) for p in paths]))
    return report
