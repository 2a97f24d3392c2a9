#!/usr/bin/env bash
# Set up, prepare MNIST and train SINGA's MNIST MLP example on one worker.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
if [ ! -f examples/mnist/data/test_data.bin ]; then
  .venv/bin/shoal prepare mnist --out examples/mnist/data
fi
exec .venv/bin/shoal run examples/mnist/job.conf --workspace "workspace/demo-$(date +%Y%m%d-%H%M%S)" "$@"
