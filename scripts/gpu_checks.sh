#!/usr/bin/env bash
# The checks a machine with a CUDA GPU runs (issue 29 point 3); CI has no GPU, so these never run there.
#   scripts/gpu_checks.sh [OUTDIR]
# 1. every test marked gpu (tests/test_cuda_*.py, the GPU rows of test_devices/test_launchers);
# 2. benchmarks/gpt.py on the GPU: shoal's one worker vs a plain loop, AllReduce over 2 processes vs DDP;
# 3. the default suite with CUDA visible (what changes when a GPU is present), bounded by SUITE_SECONDS.
# Wheels in .whl/ (protobuf, grpcio-tools for a machine without them) are installed to /tmp/site first.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:-gpu-results}
mkdir -p "$out"
PY=${PYTHON:-python3}
if compgen -G ".whl/*.whl" >/dev/null; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
{ date -u; nvidia-smi -L; "$PY" -c "import torch, google.protobuf as pb; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'gpus', torch.cuda.device_count(), 'protobuf', pb.__version__)"; } 2>&1 | tee "$out/machine.txt"

"$PY" -m pytest -q -p no:cacheprovider -m gpu -rA -n 4 --timeout 300 tests 2>&1 | tee "$out/gpu-tests.log"

if [ -f examples/gpt/data/train.txt ]; then
  "$PY" benchmarks/gpt.py --device cuda:0 --steps "${GPT_STEPS:-200}" --repeats "${GPT_REPEATS:-2}" --systems "${GPT_SYSTEMS:-shoal1,loop,shoal2,ddp}" 2>&1 | tee "$out/gpt-gpu.txt"
fi

if [ "${SUITE_SECONDS:-0}" -gt 0 ]; then  # -v: each result as it ends, so a run cut by the timeout still names its failures
  timeout "$SUITE_SECONDS" "$PY" -m pytest -v -p no:cacheprovider -n "${SUITE_WORKERS:-12}" --timeout 240 tests > "$out/suite-verbose.log" 2>&1
  echo "suite exit $?: $(grep -c ' PASSED ' "$out/suite-verbose.log") passed" > "$out/suite.log"
  grep -E ' (FAILED|ERROR) ' "$out/suite-verbose.log" >> "$out/suite.log"
  cat "$out/suite.log"
fi
