#!/usr/bin/env bash
# Set up and run the test suite (the command CI runs). Extra arguments go to pytest,
# e.g. `scripts/test.sh -m slow` for the long runs.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
# four test processes: many tests wait on the processes they start (2 idle cores, 2026-11-23: 5.0 min with 4, 5.9 with 3);
# loadgroup: the tests of one expensive module fixture (marked xdist_group) share a test process, which builds it once
# --durations: the slowest tests, listed at the end, keep the suite under its 5-minute budget visible
exec .venv/bin/python -m pytest -q -n 4 --dist loadgroup --durations=25 "$@"
