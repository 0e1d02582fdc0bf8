#!/usr/bin/env bash
# Set up .venv with the pinned dependencies, then run the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
export RAY_AUTH_MODE="${RAY_AUTH_MODE:-disabled}"  # tests start their own loopback-only Ray
export PATH="$PWD/.venv/bin:$PATH"
exec .venv/bin/python -m pytest -q "$@"
