#!/usr/bin/env bash
# Every study's results regenerate from its archived runs: runs each <root>/*/reproduce.sh in a temporary
# copy of its directory (its committed markdown other than the inputs README.md and PREREGISTRATION.md, and
# its figures, removed from the copy first) and fails when the script fails, or when the markdown it writes
# differs, byte for byte, from the committed files, lacks one of them or adds one. Figures that differ are
# listed but do not fail the check: PNG bytes depend on matplotlib's and FreeType's versions, the markdown
# does not.
#
#   bash scripts/check_reproduce.sh                          # root: experiments/ of this repository
#   bash scripts/check_reproduce.sh tests/report/fixtures    # another root
#
# A study directory holds runs.tar.xz (python -m prmppo.report.archive), RESULTS.md, its figures, and
# reproduce.sh, which regenerates them from the archive alone (no training) from inside its own directory:
#   cd "$(dirname "$0")"; "${PYTHON:-python}" -m prmppo.report runs.tar.xz --out . --name RESULTS.md ...
# PYTHON picks the interpreter (default: python, e.g. the activated environment's).
set -euo pipefail
root=$(cd "${1:-$(dirname "$0")/../experiments}" && pwd)
shopt -s nullglob
scripts=("$root"/*/reproduce.sh)
if [ ${#scripts[@]} -eq 0 ]; then
  echo "check_reproduce: no */reproduce.sh under $root: nothing to check"
  exit 0
fi
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
failed=0
for script in "${scripts[@]}"; do
  study=$(dirname "$script")
  name=$(basename "$study")
  copy="$scratch/$name"
  cp -R "$study" "$copy"
  # what reproduce.sh must write is removed first, so that a file it no longer writes is not passed unseen
  find "$copy" -maxdepth 1 \( -name '*.md' ! -name README.md ! -name PREREGISTRATION.md -o -name '*.png' \) -delete
  bad=0
  if ! bash "$copy/reproduce.sh" > "$scratch/$name.log" 2>&1; then
    echo "check_reproduce: $name: reproduce.sh failed:"
    tail -n 20 "$scratch/$name.log"
    failed=1
    continue
  fi
  for committed in "$study"/*.md; do
    file=$(basename "$committed")
    case "$file" in README.md | PREREGISTRATION.md) continue ;; esac
    if [ ! -f "$copy/$file" ]; then
      echo "check_reproduce: $name: reproduce.sh no longer writes $file"
      bad=1
    elif ! diff -u --label "committed $name/$file" --label "regenerated $name/$file" "$committed" "$copy/$file"; then
      echo "check_reproduce: $name: $file differs from what its archive regenerates (diff above)"
      bad=1
    fi
  done
  for made in "$copy"/*.md; do
    if [ ! -f "$study/$(basename "$made")" ]; then
      echo "check_reproduce: $name: reproduce.sh writes $(basename "$made"), which is not committed"
      bad=1
    fi
  done
  for figure in "$copy"/*.png; do
    if ! cmp -s "$figure" "$study/$(basename "$figure")"; then
      echo "check_reproduce: $name: note: $(basename "$figure") differs in bytes or is not committed (not a failure)"
    fi
  done
  if [ "$bad" -eq 0 ]; then echo "check_reproduce: $name: ok"; else failed=1; fi
done
exit "$failed"
