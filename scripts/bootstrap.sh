#!/usr/bin/env bash
# Create .venv (if missing) and install albert with its pinned dependencies. Idempotent and quick when done.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${ALBERT_VENV:-.venv}
if [[ ! -x "$VENV/bin/python" ]]; then
    python3 -m venv "$VENV"
fi
stamp="$VENV/.albert-installed"
if [[ ! -f "$stamp" || requirements.lock -nt "$stamp" || pyproject.toml -nt "$stamp" ]]; then
    "$VENV/bin/python" -m pip install --quiet --upgrade pip
    # torch==2.13.0 resolves to the CPU build on this machine class; see README, its first lines.
    "$VENV/bin/python" -m pip install --quiet -r requirements.lock
    "$VENV/bin/python" -m pip install --quiet --no-deps -e .
    touch "$stamp"
fi
