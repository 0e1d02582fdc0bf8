#!/usr/bin/env bash
# Set up .venv with the pinned dependencies, then run the whole test suite: the main tier, then the XLA tier
# (PJRT CPU, in its own torch-xla virtualenv cached outside the checkout). ALBERT_SKIP_XLA=1 skips the XLA tier.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
export RAY_AUTH_MODE="${RAY_AUTH_MODE:-disabled}"  # tests start their own loopback-only Ray
export PATH="$PWD/.venv/bin:$PATH"
.venv/bin/python -m pytest -q --durations=25 "$@"
if [[ "${ALBERT_SKIP_XLA:-0}" != "1" && $# -eq 0 ]]; then
    bash scripts/test_xla.sh
fi
