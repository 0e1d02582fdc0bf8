#!/usr/bin/env bash
# Run the XLA test tier (tests/xla) in the torch-xla virtualenv, on the PJRT CPU runtime unless PJRT_DEVICE is set.
# Builds the venv on first use (scripts/xla_venv.sh: ~7 GB, a few minutes); later runs reuse it.
# Extra arguments go to pytest, e.g. scripts/test_xla.sh -k checkpoint
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=$(bash scripts/xla_venv.sh | tail -n 1)
export PJRT_DEVICE="${PJRT_DEVICE:-CPU}"
if [[ "$PJRT_DEVICE" == CPU ]]; then
    # XLA:CPU's LLVM optimizations make each training-graph compile ~5x slower (measured 32 s vs 6 s) for tiny
    # models whose steps take milliseconds; the tier checks numbers and graph counts, not CPU kernel speed.
    export XLA_FLAGS="${XLA_FLAGS:-} --xla_backend_optimization_level=0"
fi
# --confcutdir: tests/conftest.py (the main suite's session fixtures) is not loaded; tests/xla has its own.
# -o addopts=...: the main suite's addopts may --ignore tests/xla; keep only its reporting and marker checks.
exec "$VENV/bin/python" -m pytest tests/xla --confcutdir=tests/xla -o addopts="-ra --strict-markers" -q "$@"
