#!/usr/bin/env bash
# The soak target (outside CI): a longer randomized fault schedule against a tiny pretraining run on a simulated
# 3-node Ray cluster (kills, stops, drains, a stalled checkpoint write); prints each fault, its recovery and what it
# lost against what its kind may lose, examples lost (must be 0); --summary FILE.json writes it.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
export RAY_AUTH_MODE="${RAY_AUTH_MODE:-disabled}"
exec .venv/bin/python bench/soak.py "$@"
