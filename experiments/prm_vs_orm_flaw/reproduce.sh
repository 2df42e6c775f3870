#!/usr/bin/env bash
# Regenerates RESULTS.md and its figures from the study's archived runs alone (no training), as
# pre-registered (PREREGISTRATION.md; the analysis is study.yaml, the deviations deviations.txt).
# Renamed to reproduce.sh when runs.tar.xz is committed: scripts/check_reproduce.sh (CI) runs every
# experiments/*/reproduce.sh and fails when the markdown it writes differs from the committed one.
#   bash experiments/prm_vs_orm_flaw/reproduce.sh            # PYTHON=... picks the interpreter
set -euo pipefail
cd "$(dirname "$0")"
"${PYTHON:-python}" -m prmppo.report.prereg runs.tar.xz --spec study.yaml --out . --name RESULTS.md \
  --preamble deviations.txt
