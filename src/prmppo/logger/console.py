"""Console output: progress bars for long loops and one summary line per PPO iteration.

On an interactive terminal every long loop (SFT steps, PRM training and labelling, PPO
iterations and their update epochs, evaluation rollouts) shows a tqdm bar, and each PPO iteration
prints one summary line above the bars. In a non-interactive log (a file, CI, a SLURM job) the
bars are off, and the summary line goes to the log every `QUIET_EVERY` iterations and at the last,
so the log stays readable; SFT and PRM training put a step line there every tenth of their
steps. `logger.console=false` turns both off; metrics.jsonl is unaffected.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Iterable

from tqdm.auto import tqdm

log = logging.getLogger("prmppo")

QUIET_EVERY = 10  # iterations between summary lines in a non-interactive log

# (metric, label, format) shown in the per-iteration summary line when present
SUMMARY_FIELDS = (
    ("rollout/accuracy", "acc", "{:.3f}"),
    ("reward/total_mean", "reward", "{:.3f}"),
    ("reward/prm_mean", "prm", "{:.3f}"),
    ("ppo/kl_ref", "kl", "{:.4f}"),
    ("ppo/entropy", "ent", "{:.3f}"),
    ("value/explained_variance", "ev", "{:.2f}"),
    ("eval/test_greedy_accuracy", "test", "{:.3f}"),
    ("rollout/response_length", "len", "{:.1f}"),
    ("perf/iteration_s", "s/it", "{:.2f}"),
)


def interactive() -> bool:
    return sys.stderr.isatty()


def progress(iterable: Iterable | None = None, *, desc: str, enabled: bool = True, total: int | None = None,
             unit: str = "it", initial: int = 0, leave: bool = True):
    """A tqdm bar on stderr, shown only when `enabled` and stderr is a terminal."""
    return tqdm(iterable, desc=desc, total=total, unit=unit, initial=initial, leave=leave, dynamic_ncols=True,
                mininterval=0.5, disable=not (enabled and interactive()))


def summary_line(label: str, iteration: int, iterations: int, metrics: dict) -> str:
    """`ppo[orm] it 12/100 acc 0.531 reward 0.531 kl 0.0031 ...` for the metrics present."""
    shown = [f"{name} {fmt.format(metrics[key])}" for key, name, fmt in SUMMARY_FIELDS
             if isinstance(metrics.get(key), (int, float))]
    return f"{label} it {iteration + 1}/{iterations} " + " ".join(shown)


def print_summary(label: str, iteration: int, iterations: int, metrics: dict, enabled: bool) -> None:
    """Every iteration on a terminal (above the bars); every QUIET_EVERY-th and the last one in a log."""
    if not enabled:
        return
    line = summary_line(label, iteration, iterations, metrics)
    if interactive():
        tqdm.write(line, file=sys.stderr)
    elif iteration % QUIET_EVERY == 0 or iteration == iterations - 1:
        log.info(line)


def log_milestone(label: str, step: int, steps: int, values: dict, enabled: bool) -> None:
    """In a non-interactive log (no bars), `sft step 300/1000 loss 0.412 ...` at every tenth of the
    steps and the last, so a long warm start or PRM training shows it is alive."""
    if not enabled or interactive():
        return
    tenth = max(steps // 10, 1)
    if (step + 1) % tenth == 0 or step == steps - 1:
        shown = " ".join(f"{k} {v:.3f}" for k, v in values.items())
        log.info(f"{label} step {step + 1}/{steps} {shown}")
