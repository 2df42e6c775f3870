"""`python -m prmppo.report <run or sweep dirs, or archives> [--out DIR] [--name report.md]`: plots and tables.

    python -m prmppo -m experiment=prm_vs_orm_arith arm=prm,orm seed=0,1,2
    python -m prmppo.report multirun/prm_vs_orm_arith/<time>          # -> <time>/report/report.md
    # a study's runs packed (prmppo.report.archive), then its RESULTS.md from the archive alone
    python -m prmppo.report.archive multirun/<study> --out experiments/<study>/runs.tar.xz
    python -m prmppo.report experiments/<study>/runs.tar.xz --out experiments/<study> --name RESULTS.md

Finds every run under the given directories and `*.tar.xz` archives, groups them by arm and swept
keys (seeds are the replicates), and writes into `--out` (default `<first dir>/report`, beside an
archive for an archive):
  - `accuracy.png`: test accuracy vs PPO iterations per group, 95% confidence band across seeds;
  - `rewards.png`: reward components and KL per iteration; `hacking.png`: hacking monitors;
  - `report.md` (`--name`): final greedy, sampled and pass@k test accuracy mean +- 95% CI per group
    (during PPO and, for pipeline runs, the final evaluation, with the SFT policy's as the baseline),
    learned PRM - ORM and oracle PRM - ORM for each (paired by seed when both arms ran the same
    seeds), iterations to reach `--threshold` greedy accuracy, the reward-hacking table when PRM
    monitors were logged (with the first iteration whose PRM-score minus true-step-accuracy gap
    exceeds `--gap-threshold`), each sweep's command, wall time and hardware, and the runs that
    failed or did not finish.
The same inputs give the same markdown, byte for byte (`write.py`).
Bad inputs (no runs, an unreadable metrics line, a damaged archive) exit 2 with one line naming the file.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from prmppo.errors import EXIT_REFUSED
from prmppo.report.archive import is_archive
from prmppo.report.hacking import GAP_THRESHOLD
from prmppo.report.runs import ReportError
from prmppo.report.write import write_report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m prmppo.report", description=__doc__.splitlines()[0])
    parser.add_argument("dirs", nargs="+", help="run or sweep directories (searched recursively), or *.tar.xz "
                                                "archives of runs (python -m prmppo.report.archive)")
    parser.add_argument("--out", default=None, help="output directory (default: <first dir>/report)")
    parser.add_argument("--threshold", type=float, default=0.5,
                        help="greedy test accuracy whose first crossing is reported (default 0.5)")
    parser.add_argument("--gap-threshold", type=float, default=GAP_THRESHOLD,
                        help="PRM score minus true step accuracy whose first crossing is reported per seed "
                             f"(default {GAP_THRESHOLD:g})")
    parser.add_argument("--name", default="report.md", help="the markdown file's name (default report.md)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="prmppo.report: %(message)s")
    first = Path(args.dirs[0])
    out = Path(args.out) if args.out else (first.parent if is_archive(first) else first) / "report"
    try:
        report = write_report(args.dirs, out, args.threshold, args.name, args.gap_threshold)
    except ReportError as err:
        print(f"prmppo.report: error: {err}", file=sys.stderr)
        return EXIT_REFUSED
    print(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
