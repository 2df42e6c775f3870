"""The report's figures (matplotlib, no display needed): one line per group, a 95% band across seeds.

- `accuracy_figure`: test accuracy (greedy, sampled, pass@k) against PPO iterations done;
- `metrics_figure`: per-iteration training metrics, e.g. reward components or hacking monitors.
Each returns a `matplotlib.figure.Figure`; `save` writes it as PNG.
"""

from __future__ import annotations

import math
from pathlib import Path

from matplotlib.figure import Figure

from prmppo.report.runs import Grouping, per_seed
from prmppo.report.stats import mean_ci
from prmppo.report.tables import EVAL_STAGE, GREEDY, X_KEY, measures

REWARD_METRICS = ("reward/total_mean", "reward/outcome_mean", "reward/prm_mean", "ppo/kl_ref")
HACK_METRICS = ("prm/score_mean", "hack/true_step_accuracy", "hack/prm_vs_true_step_gap",
                "hack/prm_score_minus_accuracy", "hack/repeated_line_rate", "hack/steps_per_response",
                "rollout/response_length", "rollout/truncated_fraction")


def _band(ax, grouping: Grouping, stage: str, metric: str, x_key: str | None) -> bool:
    """Draw each group's mean curve and 95% band of `metric`; False when no group has it."""
    drawn = False
    for index, (group, runs) in enumerate(grouping.groups.items()):
        seeds = per_seed(runs, stage, metric, x_key)
        if not seeds:
            continue
        xs = sorted(set.intersection(*(set(s) for s in seeds.values())))
        estimates = [mean_ci([s[x] for s in seeds.values()]) for x in xs]
        mean = [e.mean for e in estimates]
        color = f"C{index % 10}"
        ax.plot(xs, mean, color=color, marker="o" if len(xs) < 30 else None, markersize=3,
                label=f"{grouping.label(group)} (n={len(seeds)})")
        if len(seeds) > 1:
            half = [0.0 if math.isnan(e.half_width) else e.half_width for e in estimates]
            ax.fill_between(xs, [m - h for m, h in zip(mean, half)], [m + h for m, h in zip(mean, half)],
                            color=color, alpha=0.2, linewidth=0)
        drawn = True
    return drawn


def accuracy_figure(grouping: Grouping) -> Figure:
    """A panel per test accuracy logged during PPO: greedy, sampled, pass@k (those the runs logged)."""
    logged = [m for m in measures([run for runs in grouping.groups.values() for run in runs]) if m.stage == EVAL_STAGE]
    logged = logged or [GREEDY]
    fig = Figure(figsize=(5.5 * len(logged), 4.2), layout="constrained")
    axes = fig.subplots(1, len(logged), sharey=True, squeeze=False).ravel()
    for ax, measure in zip(axes, logged):
        _band(ax, grouping, EVAL_STAGE, measure.metric, X_KEY)
        ax.set(title=f"test accuracy ({measure.name})", xlabel="PPO iterations", ylabel="accuracy")
        ax.grid(alpha=0.3)
    _figure_legend(fig, axes)
    fig.suptitle("Test accuracy vs PPO iterations: mean across seeds, 95% CI band")
    return fig


def metrics_figure(grouping: Grouping, metrics: tuple[str, ...], title: str) -> Figure | None:
    """A panel per metric that any run logged (`ppo` rows, x = iterations done); None when none did."""
    present = [m for m in metrics if any(run.series("ppo", m) for runs in grouping.groups.values() for run in runs)]
    if not present:
        return None
    columns = min(3, len(present))
    rows = math.ceil(len(present) / columns)
    fig = Figure(figsize=(4.2 * columns, 3.4 * rows), layout="constrained")
    axes = fig.subplots(rows, columns, squeeze=False).ravel()
    for ax, metric in zip(axes, present):
        _band(ax, grouping, "ppo", metric, None)
        ax.set(title=metric, xlabel="PPO iterations")
        ax.grid(alpha=0.3)
    for ax in axes[len(present):]:
        ax.set_visible(False)
    _figure_legend(fig, axes)
    fig.suptitle(title)
    return fig


def _figure_legend(fig: Figure, axes) -> None:
    """One legend under the panels with every group drawn in any of them (a group may lack a metric)."""
    entries: dict[str, object] = {}
    for ax in axes:
        for handle, label in zip(*ax.get_legend_handles_labels()):
            entries.setdefault(label, handle)
    if entries:
        # as many columns as fit the figure's width at ~12 characters an inch (fontsize 8), at most 4
        fits = int(fig.get_figwidth() * 12 // max(len(label) for label in entries))
        fig.legend(list(entries.values()), list(entries), loc="outside lower center",
                   ncols=max(1, min(4, len(entries), fits)), fontsize=8)


def save(fig: Figure, path: Path) -> Path:
    """PNG without the software's name and version (matplotlib writes them by default), so the same figure
    gives the same bytes on machines with other matplotlib versions where the drawing itself agrees."""
    fig.savefig(path, dpi=110, bbox_inches="tight", metadata={"Software": None})
    return path
