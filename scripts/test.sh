#!/usr/bin/env bash
# Set up and run the test suite (the command CI runs). Extra arguments go to pytest,
# e.g. `scripts/test.sh -m slow` for the long runs.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
# Python caches what it compiles: shoal's modules, imported again by each of the suite's few hundred interpreters, and
# pytest's rewritten test modules, which each test process otherwise rewrites on its own (2026-11-29, idle: 3 min 37 s
# instead of 3 min 50 s once cached). An environment that turns the cache off (PYTHONDONTWRITEBYTECODE) is overruled here.
unset PYTHONDONTWRITEBYTECODE
# four test processes: many tests wait on the processes they start (2 idle cores, 2026-11-23: 5.0 min with 4, 5.9 with 3;
# 2026-11-29, since the waits sleep: 3 min 51 s - 4 min 3 s with 4, 3 min 56 s with 3, the cores ~97 % busy either way);
# loadgroup: the tests of one expensive module fixture (marked xdist_group) share a test process, which builds it once
# --durations: the slowest tests, listed at the end, keep the suite under its 5-minute budget visible
exec .venv/bin/python -m pytest -q -n 4 --dist loadgroup --durations=25 "$@"
