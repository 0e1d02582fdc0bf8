#!/usr/bin/env bash
# Set up .venv with the pinned dependencies, then run the main job end to end on the embedded default:
# an in-process local Ray, the sample corpus assembled from registry packages.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/bootstrap.sh
export PATH="$PWD/.venv/bin:$PATH"
exec albert demo "$@"
