"""The study's figures (matplotlib, no display), each a mean curve per arm with its 95% t band across seeds:

- `accuracy_primary.png`: greedy accuracy and pass@K of the test evaluation during PPO, baseline and primary
  arm over the primary seeds;
- `accuracy_secondary.png`: a row per secondary comparison (and the compute-matched one), the arm and the arm
  it is compared with over that comparison's seeds;
- `prm_vs_true_step.png`: for every arm whose `ppo` rows hold the PRM's mean step score and the true step
  accuracy by the task's checker (`prm/score_mean`, `hack/true_step_accuracy`), both over PPO iterations.
Saved by `plots.save` (no software name or date in the PNG).
"""

from __future__ import annotations

from pathlib import Path

from matplotlib.figure import Figure

from prmppo.report.hacking import MONITORS
from prmppo.report.plots import save
from prmppo.report.prereg.study import Study
from prmppo.report.stats import mean_ci

SCORE, TRUE_STEPS = MONITORS["PRM score"], MONITORS["true step acc."]


def band(ax, curves: dict[int, dict[int, float]], label: str, color: str, style: str = "-") -> None:
    """Mean of `{seed: {x: y}}` at the x every seed has, with its 95% t band (none for one seed)."""
    if not curves:
        return
    xs = sorted(set.intersection(*(set(c) for c in curves.values())))
    estimates = [mean_ci([c[x] for c in curves.values()]) for x in xs]
    mean = [e.mean for e in estimates]
    ax.plot(xs, mean, style, color=color, marker="o" if len(xs) < 30 else None, markersize=3,
            label=f"{label} (n={len(curves)})")
    if len(curves) > 1:
        ax.fill_between(xs, [m - e.half_width for m, e in zip(mean, estimates)],
                        [m + e.half_width for m, e in zip(mean, estimates)], color=color, alpha=0.2, linewidth=0)


def _curves(study: Study, arm: str, metric: str, seeds) -> dict[int, dict[int, float]]:
    runs = study.ppo.get(arm, {})
    return {s: c for s in sorted(seeds) if s in runs and (c := runs[s].curve(metric))}


def _pair_panels(axes, study: Study, pair: tuple[str, str], metrics: list[str], seeds, title: str) -> None:
    for ax, metric in zip(axes, metrics):
        for index, arm in enumerate(pair):
            band(ax, _curves(study, arm, metric, seeds), arm, f"C{index}")
        ax.set(title=f"{title}: {metric}", xlabel="PPO iterations", ylabel="test accuracy", ylim=(0, 1.02))
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="lower right")


def _metrics(study: Study) -> list[str]:
    """greedy and the pass@K of the endpoints (the first K), as the figures' columns."""
    passes = [e.metric for e in study.spec.endpoints if e.metric.startswith("pass@")]
    return ["greedy", *passes[:1]]


def primary_figure(study: Study) -> Figure:
    spec, metrics = study.spec, _metrics(study)
    fig = Figure(figsize=(5.5 * len(metrics), 4.2), layout="constrained")
    axes = fig.subplots(1, len(metrics), squeeze=False).ravel()
    _pair_panels(axes, study, (spec.baseline, spec.primary), metrics, spec.seeds, "primary")
    fig.suptitle("Test accuracy during PPO (200 test prompts): mean across seeds, 95% t band")
    return fig


def secondary_figure(study: Study) -> Figure | None:
    spec, metrics = study.spec, _metrics(study)
    rows = [((c.against, c.arm), c.seeds, c.label) for c in spec.secondary]
    if spec.compute_matched:
        m = spec.compute_matched
        rows.append(((m.against, m.arm), m.seeds, m.label))
    if not rows:
        return None
    fig = Figure(figsize=(5.0 * len(metrics), 3.2 * len(rows)), layout="constrained")
    axes = fig.subplots(len(rows), len(metrics), squeeze=False)
    for row_axes, (pair, seeds, label) in zip(axes, rows):
        _pair_panels(row_axes, study, pair, metrics, seeds, label)
    fig.suptitle("SECONDARY: test accuracy during PPO, each arm against its comparison arm, 95% t band")
    return fig


def prm_figure(study: Study) -> Figure | None:
    """A panel per arm that logged both monitors: the PRM's mean step score and the true step accuracy."""
    arms = [arm for arm in study.spec.arms() if any(r.run.series("ppo", SCORE) and r.run.series("ppo", TRUE_STEPS)
                                                    for r in study.ppo.get(arm, {}).values())]
    if not arms:
        return None
    columns = min(3, len(arms))
    rows = -(-len(arms) // columns)
    fig = Figure(figsize=(4.6 * columns, 3.4 * rows), layout="constrained")
    axes = fig.subplots(rows, columns, squeeze=False).ravel()
    for ax, arm in zip(axes, arms):
        runs = study.ppo[arm]
        for index, (metric, label) in enumerate(((SCORE, "PRM mean step score"), (TRUE_STEPS, "true step accuracy"))):
            curves = {s: c for s, r in sorted(runs.items()) if (c := r.run.series("ppo", metric))}
            band(ax, curves, label, f"C{index + 2}")
        ax.set(title=arm, xlabel="PPO iterations", ylim=(0, 1.02))
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="lower right")
    for ax in axes[len(arms):]:
        ax.set_visible(False)
    fig.suptitle("PRM score vs true step accuracy of the policy's samples during PPO, 95% t band")
    return fig


def write_figures(study: Study, out_dir: Path) -> list[tuple[str, str]]:
    """Write the figures that have data into `out_dir`; returns `(file name, caption)` of each."""
    made = []
    for file, make, caption in (
            ("accuracy_primary.png", primary_figure, "Primary arms: test accuracy vs PPO iterations"),
            ("accuracy_secondary.png", secondary_figure, "SECONDARY arms against their comparison arms"),
            ("prm_vs_true_step.png", prm_figure, "PRM score vs true step accuracy over training, every PRM arm")):
        fig = make(study)
        if fig is not None:
            save(fig, out_dir / file)
            made.append((file, caption))
    return made
