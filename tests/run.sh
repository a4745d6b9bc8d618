#!/usr/bin/env bash
# The test suite as `make test` (and CI) runs it, in two pytest runs side by side on the
# machine's cores: tests/test_slurm.py (mostly waiting on the scheduler) with the pipeline
# tests that need no other module's fixtures but the demo (atomic outputs, held-out passes,
# QLoRA, sweeps), and the rest. The local demo both need is built once, by whichever gets
# to it first (SNAKETUNE_SHARED_DIR, tests/conftest.py). Extra arguments go to both runs.
set -uo pipefail
SIDE=(tests/test_atomic.py tests/test_heldout.py tests/test_qlora.py tests/test_slurm.py tests/test_sweep.py)
shared=$(mktemp -d "${TMPDIR:-/tmp}/snaketune-tests.XXXXXX")
export SNAKETUNE_SHARED_DIR=$shared
pytest "${SIDE[@]}" "$@" > "$shared/side.log" 2>&1 &
side_pid=$!
trap 'kill $side_pid 2>/dev/null' INT TERM
pytest "${SIDE[@]/#/--ignore=}" "$@"
main=$?
wait "$side_pid"
side=$?
echo "========== ${SIDE[*]} (ran beside the rest) =========="
cat "$shared/side.log"
rm -rf "$shared"
echo "pytest exit codes: ${SIDE[*]}: $side; the rest: $main"
[ "$main" -eq 0 ] || exit "$main"
exit "$side"
