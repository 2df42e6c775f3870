"""`python -m prmppo.report.prereg <runs.tar.xz> --spec study.yaml --out DIR`: a pre-registered study's results.

    cd experiments/prm_vs_orm_flaw
    python -m prmppo.report.prereg runs.tar.xz --spec study.yaml --out . --name RESULTS.md --preamble deviations.txt

Reads the study file and the archived runs (see `prmppo.report.prereg`), writes RESULTS.md (`--name`) and its
figures into `--out`. The same archive and study file give the same markdown, byte for byte. A bad study
file, a damaged archive or a run that contradicts its place in it exits 2 with one line naming what is wrong;
a run that is absent or did not finish is listed as missing in the results, not refused.
"""

from __future__ import annotations

import argparse
import logging
import sys

from prmppo.errors import EXIT_REFUSED
from prmppo.report.prereg import write_results
from prmppo.report.runs import ReportError


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m prmppo.report.prereg", description=__doc__.splitlines()[0])
    parser.add_argument("runs", help="the study's runs: a *.tar.xz archive (python -m prmppo.report.archive), or "
                                     "the directory one was unpacked into")
    parser.add_argument("--spec", required=True, help="the study file (YAML): arms, seeds, endpoints, comparisons")
    parser.add_argument("--out", required=True, help="the directory to write the results and figures into")
    parser.add_argument("--name", default="RESULTS.md", help="the markdown file's name (default RESULTS.md)")
    parser.add_argument("--preamble", default=None,
                        help="a text file put verbatim at the top (the deviations from the pre-registration)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="prmppo.report.prereg: %(message)s")
    try:
        path = write_results(args.runs, args.spec, args.out, args.name, args.preamble)
    except ReportError as err:
        print(f"prmppo.report.prereg: error: {err}", file=sys.stderr)
        return EXIT_REFUSED
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
