#!/usr/bin/env bash
# Set up, prepare MNIST and train SINGA's MNIST MLP example on one worker for 300 steps (a few
# minutes on 2 cores) into workspace/mnist-mlp, the job's own workspace, where README.md's tour
# goes on. Extra arguments go to `shoal run`: ./scripts/demo.sh --set train_steps=1000 trains longer.
# A run already in workspace/mnist-mlp is kept, renamed with the time it was moved aside.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
if [ ! -f examples/mnist/data/test_data.bin ]; then
  .venv/bin/shoal prepare mnist --out examples/mnist/data
fi
workspace=workspace/mnist-mlp
if [ -e "$workspace" ]; then
  kept="$workspace-$(date +%Y%m%d-%H%M%S)"
  mv "$workspace" "$kept"
  echo "The earlier run in $workspace is now in $kept"
fi
.venv/bin/shoal run examples/mnist/job.conf --set train_steps=300 "$@"
cat <<NEXT

Next (README.md goes on from here):
  source .venv/bin/activate                     # puts shoal on PATH in this shell
  shoal run examples/mnist/job.conf --test      # test the checkpoint this run just wrote
  shoal run examples/mnist/job.conf --resume    # train on from it, to the job's 1000 steps
NEXT
