#!/usr/bin/env bash
# The test suite as `make test` (and CI) runs it. tests/test_slurm.py mostly waits on the
# scheduler, so it runs in a second pytest beside the rest; the local demo both need is
# built once, by whichever gets to it first (SNAKETUNE_SHARED_DIR, tests/conftest.py).
# Extra arguments go to both pytest runs.
set -uo pipefail
shared=$(mktemp -d "${TMPDIR:-/tmp}/snaketune-tests.XXXXXX")
export SNAKETUNE_SHARED_DIR=$shared
pytest tests/test_slurm.py "$@" > "$shared/slurm.log" 2>&1 &
slurm=$!
trap 'kill $slurm 2>/dev/null' INT TERM
pytest --ignore=tests/test_slurm.py "$@"
main=$?
wait "$slurm"
side=$?
echo "========== tests/test_slurm.py (ran beside the rest) =========="
cat "$shared/slurm.log"
rm -rf "$shared"
echo "pytest exit codes: tests/test_slurm.py $side, the rest $main"
[ "$main" -eq 0 ] || exit "$main"
exit "$side"
