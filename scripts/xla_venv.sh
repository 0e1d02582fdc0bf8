#!/usr/bin/env bash
# Build (or reuse) the XLA virtualenv and print its path on the last line of stdout.
#
# torch-xla 2.9.0 needs torch 2.9.0 exactly (its wheel does not pin it), so the XLA tier cannot share .venv
# (torch 2.13). The venv is ~7 GB and lives outside the checkout:
#     ${ALBERT_XLA_VENV:-$HOME/.cache/albert/venv-xla}
# albert itself is installed editable with --no-deps, plus the deps albert_core, services/train (the XLA backend and the Ray Train
# loop) import: ray[train,data] adds ~0.4 GB and ~1 minute to a fresh build (tests/xla/test_xla_train.py
# runs a real Ray Train run). Ray's own dependencies are held at requirements.lock's versions (torch excepted).
# Idempotent: a stamp file records what was installed; rerunning is a no-op unless pyproject.toml, requirements.lock
# or this script changed.
set -euo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD
VENV=${ALBERT_XLA_VENV:-$HOME/.cache/albert/venv-xla}
PYTHON=${ALBERT_XLA_PYTHON:-python3}

# Pins: torch/torch-xla from pyproject's [xla] extra; the rest match requirements.lock.
PKGS=(
    "torch==2.9.0"
    "torch-xla==2.9.0"
    "numpy==2.4.6"
    "safetensors==0.8.0"
    "sentencepiece==0.2.3"
    "pyarrow==26.0.1"
    "fsspec==2026.9.0"
    "pytest==9.2.0"
    "ray[train,data]==2.60.0"
)

if [[ ! -x "$VENV/bin/python" ]]; then
    mkdir -p "$(dirname "$VENV")"
    "$PYTHON" -m venv "$VENV"
fi

stamp="$VENV/.albert-xla-installed"
want="$(printf '%s\n' "${PKGS[@]}" "$REPO")"
if [[ ! -f "$stamp" || "$(cat "$stamp")" != "$want" || pyproject.toml -nt "$stamp" || requirements.lock -nt "$stamp" ||
    "$REPO/scripts/xla_venv.sh" -nt "$stamp" ]]; then
    constraints="$VENV/.albert-xla-constraints.txt"
    grep -v -e '^#' -e '^torch==' requirements.lock >"$constraints"
    "$VENV/bin/python" -m pip install --quiet --upgrade pip >&2
    "$VENV/bin/python" -m pip install --quiet -c "$constraints" "${PKGS[@]}" >&2
    "$VENV/bin/python" -m pip install --quiet --no-deps -e "$REPO" >&2
    # Fail here, not in the tests, when the pair is inconsistent (e.g. a torch upgrade slipped in).
    "$VENV/bin/python" - >&2 <<'EOF'
import ray, torch, torch_xla
assert torch.__version__.split("+")[0] == "2.9.0", f"XLA venv has torch {torch.__version__}, torch-xla needs 2.9.0"
print(f"torch {torch.__version__}, torch_xla {torch_xla.__version__}, ray {ray.__version__}")
EOF
    printf '%s' "$want" >"$stamp"
fi
echo "$VENV"
