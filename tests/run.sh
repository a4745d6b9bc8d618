#!/usr/bin/env bash
# The test suite, in two tiers:
#
#   bash tests/run.sh quick    # `make test`: every unit and property test and the checks on
#                              # one shared demo pipeline (-m "not slow"), one pytest run
#   bash tests/run.sh all      # `make test-all`, what CI runs: everything but the
#                              # benchmarks that train, in four pytest runs side by side
#   bash tests/run.sh bench    # `make test-bench`: the short forms of the benchmarks that
#                              # train or convert models (marker bench), one pytest run
#
# The full tier's four runs share the local demo (built once, by whichever gets to it
# first: SNAKETUNE_SHARED_DIR, tests/conftest.py). A session fixture is built once per run,
# so each chain that starts from the demo lives in one run only. The split balances what
# each run costs in CPU seconds (measured from a fresh clone: docs/testing.md); four runs
# on two cores, not three, so that one run's waits (the scheduler, a lock, a timeout) leave
# no core idle while another has work:
#   - SLURM: tests/test_slurm.py, mostly waiting on the scheduler (its own demo on the
#     cluster), with the training, continuation, stall, export and disk tests (the full
#     ZeRO-3 fixture they share) and the larger-than-one-GPU and mixture-of-experts tests
#     (on the shared demo) filling the waits;
#   - SIDE: the GRPO, QLoRA and reward model chains and the atomic-output fault test;
#   - CHAINS: sweeps, then the DPO chain;
#   - the rest, the quick tier and the held-out passes among them.
# The GRPO and DPO chains share their start (the sft_demo fixture): the GRPO chain, first
# in its run, builds it; the DPO chain's run trains its sweeps meanwhile.
# Extra arguments go to pytest (every run).
set -uo pipefail
tier=${1:-all}
shift || true
shared=$(mktemp -d "${TMPDIR:-/tmp}/snaketune-tests.XXXXXX")
export SNAKETUNE_SHARED_DIR=$shared
# every process the tests start notes its CPU seconds here (tests/offline/sitecustomize.py)
export SNAKETUNE_CPU_LOG=$shared/cpu.tsv

if [ "$tier" = quick ]; then
  pytest -m "not slow" --junitxml="$shared/quick.xml" "$@"
  status=$?
  python tests/durations.py "$shared/quick.xml" --cpu "$SNAKETUNE_CPU_LOG"
  rm -rf "$shared"
  exit $status
fi
if [ "$tier" = bench ]; then
  pytest tests/test_bench.py -m bench --junitxml="$shared/bench.xml" "$@"
  status=$?
  python tests/durations.py "$shared/bench.xml" --cpu "$SNAKETUNE_CPU_LOG"
  rm -rf "$shared"
  exit $status
fi
if [ "$tier" != all ]; then
  echo "usage: tests/run.sh [quick|all|bench] [pytest arguments]" >&2
  exit 2
fi

SLURM=(tests/test_slurm.py tests/test_train.py tests/test_topology.py tests/test_stall.py
       tests/test_export.py tests/test_diskplan.py tests/test_big_models.py tests/test_moe.py)
SIDE=(tests/test_grpo.py tests/test_qlora.py tests/test_reward_model.py tests/test_atomic.py)
CHAINS=(tests/test_sweep.py tests/test_dpo.py)
pytest "${SLURM[@]}" -m "not bench" --junitxml="$shared/slurm.xml" "$@" > "$shared/slurm.log" 2>&1 &
slurm_pid=$!
pytest "${SIDE[@]}" -m "not bench" --junitxml="$shared/side.xml" "$@" > "$shared/side.log" 2>&1 &
side_pid=$!
pytest "${CHAINS[@]}" -m "not bench" --junitxml="$shared/chains.xml" "$@" > "$shared/chains.log" 2>&1 &
chains_pid=$!
trap 'kill $slurm_pid $side_pid $chains_pid 2>/dev/null' INT TERM
pytest "${SLURM[@]/#/--ignore=}" "${SIDE[@]/#/--ignore=}" "${CHAINS[@]/#/--ignore=}" \
  -m "not bench" --junitxml="$shared/main.xml" "$@"
main=$?
wait "$side_pid"
side=$?
wait "$chains_pid"
chains=$?
wait "$slurm_pid"
slurm=$?
echo "========== ${SIDE[*]} (ran beside the rest) =========="
cat "$shared/side.log"
echo "========== ${CHAINS[*]} (ran beside the rest) =========="
cat "$shared/chains.log"
echo "========== ${SLURM[*]} (ran beside the rest) =========="
cat "$shared/slurm.log"
python tests/durations.py "$shared"/*.xml --cpu "$SNAKETUNE_CPU_LOG"
rm -rf "$shared"
echo "pytest exit codes: the rest: $main; ${SIDE[*]}: $side; ${CHAINS[*]}: $chains;" \
  "${SLURM[*]}: $slurm"
for code in "$main" "$side" "$chains" "$slurm"; do
  [ "$code" -eq 0 ] || exit "$code"
done
