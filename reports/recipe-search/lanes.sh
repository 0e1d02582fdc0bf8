#!/usr/bin/env bash
# Run recipe-search cells (bench/recipe_search.py), two at a time with one thread each, so each cell's budget is
# CPU seconds of one core whatever else the machine runs.
# usage: bash reports/recipe-search/lanes.sh CELLS OUT BUDGET [SHARDS]
#   CELLS   a file, one cell's recipe_search.py arguments per line (# comments); see reports/recipe-search/cells/
#   OUT     the JSON-lines results file cells append to
#   BUDGET  CPU seconds of training per cell (600 = 5 minutes of a 2-core machine's time)
# Run it from a copy of the checkout when you keep editing the code meanwhile (cells import the tree they run in).
set -uo pipefail
cd "$(dirname "$0")/../.."
CELLS=$1; OUT=$2; BUDGET=$3; SHARDS=${4:-.cache/albert/sample-shards-8000-128}
PYTHON=${ALBERT_PYTHON:-.venv/bin/python}
run() { "$PYTHON" bench/recipe_search.py --shards "$SHARDS" --threads 1 --budget "$BUDGET" --evals 5 --fit-schedule 0.1 --out "$OUT" "$@"; }
i=0
while IFS= read -r line; do
  [[ -z "$line" || "$line" == \#* ]] && continue
  # shellcheck disable=SC2086  # a cell's line is its argument list
  run $line &
  i=$((i+1))
  if (( i % 2 == 0 )); then wait; fi
done < "$CELLS"
wait
