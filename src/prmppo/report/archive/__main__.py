"""`python -m prmppo.report.archive <run or sweep dirs> --out experiments/<study>/runs.tar.xz`: pack a study's runs.

    python -m prmppo.report.archive multirun/<study> --out experiments/<study>/runs.tar.xz
    python -m prmppo.report experiments/<study>/runs.tar.xz --out experiments/<study> --name RESULTS.md

Keeps each run's config, overrides, metrics, evaluation, results and run info (no weights, no
checkpoints), deterministically: the same runs give the same bytes. Refuses, writing nothing, an
archive above 25 MB. See `prmppo.report.archive`. Exits 2 with one line on a refusal.
"""

from __future__ import annotations

import argparse
import sys

from prmppo.errors import EXIT_REFUSED
from prmppo.report.archive import MAX_BYTES, ArchiveError, pack


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m prmppo.report.archive", description=__doc__.splitlines()[0])
    parser.add_argument("dirs", nargs="+", help="run or sweep directories (searched recursively)")
    parser.add_argument("--out", required=True, help="the archive to write, a *.tar.xz path")
    args = parser.parse_args(argv)
    try:
        files = pack(args.dirs, args.out, MAX_BYTES)
    except ArchiveError as err:
        print(f"prmppo.report.archive: error: {err}", file=sys.stderr)
        return EXIT_REFUSED
    runs = sum(name.endswith("/.hydra/config.yaml") for name in files)
    print(f"{args.out}: {runs} runs, {len(files)} files")
    return 0


if __name__ == "__main__":
    sys.exit(main())
