#!/usr/bin/env bash
# The test suite by tier (docs/testing.md says what goes where, and why):
#
#   bash tests/run.sh quick      # `make test`: every unit and property test and the checks on
#                                # one shared demo pipeline (-m "not slow"), one pytest run
#   bash tests/run.sh ci         # `make test-ci`, what .ci/run runs: the quick tier and one
#                                # end-to-end test of every capability, the chains short
#                                # (-m "not extended and not bench"), four pytest runs side by side
#   bash tests/run.sh extended   # `make test-extended`: the rest (-m extended): documented lengths
#                                # and learning thresholds, each chain's own fault tests,
#                                # benchmarks' short forms, four pytest runs side by side
#   bash tests/run.sh bench      # `make test-bench`: the short forms of the benchmarks that
#                                # train or convert models (marker bench), one pytest run
#   bash tests/run.sh all        # `make test-all`: ci, then extended, then bench
#   bash tests/run.sh touched [BASE]   # `make test-touched`: the extended tests whose code
#                                # the change since BASE (default HEAD) touches (tests/touched.py)
#
# A side-by-side tier's four runs share the local demo (built once, by whichever gets to it
# first: SNAKETUNE_SHARED_DIR, tests/conftest.py). A session fixture is built once per run,
# so each chain that starts from the demo lives in one run only. The split balances what
# each run costs in CPU seconds; four runs on two cores, not three, so that one run's waits
# (the scheduler, a lock, a timeout) leave no core idle while another has work:
#   - SLURM: tests/test_slurm.py, mostly waiting on the scheduler, with the training,
#     continuation, stall, export, disk, larger-than-one-GPU and mixture-of-experts tests,
#     the agents' and the pictures' (which use the cores the scheduler's waits leave);
#   - SIDE: the GRPO, QLoRA and reward model chains, the atomic-output fault test and the
#     bad inputs (their own demo copies);
#   - CHAINS: sweeps, then the DPO chain and the families;
#   - the rest, the quick tier and the held-out passes among them.
# SNAKETUNE_TIER tells the fixtures which tier runs: "ci" trains the chains short
# (conftest.CI_RUNS). SNAKETUNE_KEEP=DIR keeps the tier's logs there (tests/touched.py
# --record DIR writes the map of what each test loads). Extra arguments go to pytest; tests
# named among them run in one pytest run, not four.
set -uo pipefail
tier=${1:-all}
shift || true
here=$(cd "$(dirname "$0")" && pwd)

if [ "$tier" = all ]; then
  start=$SECONDS
  bash "$here/run.sh" ci "$@"
  ci=$?
  bash "$here/run.sh" extended "$@"
  extended=$?
  bash "$here/run.sh" bench "$@"
  bench=$?
  echo "make test-all: ci $ci, extended $extended, bench $bench (exit codes);" \
    "$(( (SECONDS - start) / 60 )) min $(( (SECONDS - start) % 60 )) s in all"
  for code in "$ci" "$extended" "$bench"; do
    [ "$code" -eq 0 ] || exit "$code"
  done
  exit 0
fi
if [ "$tier" = touched ]; then
  exec python "$here/touched.py" "$@"
fi

shared=$(mktemp -d "${TMPDIR:-/tmp}/snaketune-tests.XXXXXX")
export SNAKETUNE_SHARED_DIR=$shared SNAKETUNE_TIER=$tier
# every process the tests start notes its CPU seconds (and the library modules it loaded:
# tests/touched.py) here (tests/offline/sitecustomize.py)
export SNAKETUNE_CPU_LOG=$shared/cpu.tsv
tier_start=$SECONDS

account() {  # the tier's figures: slowest files, CPU per file and per kind of process
  python "$here/durations.py" "$shared"/*.xml --cpu "$SNAKETUNE_CPU_LOG" \
    --tier "$tier" --wall $((SECONDS - tier_start))
  if [ -n "${SNAKETUNE_KEEP:-}" ]; then  # the logs tests/touched.py --record reads, the CPU log
    mkdir -p "$SNAKETUNE_KEEP"
    cp "$shared"/*.xml "$SNAKETUNE_CPU_LOG"* "$SNAKETUNE_KEEP"/ 2>/dev/null
  fi
  rm -rf "$shared"
}

case "$tier" in
  quick) marks="not slow" ;;
  bench) marks="bench" ;;
  ci) marks="not extended and not bench" ;;
  extended) marks="extended" ;;
  *)
    echo "usage: tests/run.sh [quick|ci|extended|bench|all|touched] [pytest arguments]" >&2
    exit 2
    ;;
esac

# Tests named among the extra arguments (a file, a test id) run once, in one pytest run with
# the tier's marks: given to each of the four side-by-side runs below, each would run them
# at the same time as the others (two SLURM tests at once cancel each other's jobs).
named=
for arg in "$@"; do
  case "$arg" in
    -*) ;;  # an option (--ignore=tests/x.py names no test to run)
    tests/* | *::* | *.py) named=1 ;;
  esac
done
if [ "$tier" = quick ] || [ "$tier" = bench ] || [ -n "$named" ]; then
  files=()
  [ "$tier" = bench ] && [ -z "$named" ] && files=(tests/test_bench.py)
  pytest "${files[@]}" -m "$marks" --junitxml="$shared/$tier.xml" "$@"
  status=$?
  account
  exit $status
fi

SLURM=(tests/test_slurm.py tests/test_train.py tests/test_topology.py tests/test_stall.py
       tests/test_export.py tests/test_diskplan.py tests/test_big_models.py tests/test_moe.py
       tests/test_examples.py tests/test_bench.py tests/test_agents.py tests/test_pictures.py)
SIDE=(tests/test_grpo.py tests/test_rloo.py tests/test_qlora.py tests/test_reward_model.py tests/test_atomic.py
      tests/test_sequence.py tests/test_bad_inputs.py)
CHAINS=(tests/test_sweep.py tests/test_dpo.py tests/test_task_eval.py tests/test_cost.py tests/test_families.py)
# pytest exits 5 when a run selects no test (a tier may leave a group empty): not a failure
ran() { [ "$1" -eq 5 ] && echo 0 || echo "$1"; }
pytest "${SLURM[@]}" -m "$marks" --junitxml="$shared/slurm.xml" "$@" > "$shared/slurm.log" 2>&1 &
slurm_pid=$!
pytest "${SIDE[@]}" -m "$marks" --junitxml="$shared/side.xml" "$@" > "$shared/side.log" 2>&1 &
side_pid=$!
pytest "${CHAINS[@]}" -m "$marks" --junitxml="$shared/chains.xml" "$@" > "$shared/chains.log" 2>&1 &
chains_pid=$!
trap 'kill $slurm_pid $side_pid $chains_pid 2>/dev/null' INT TERM
pytest "${SLURM[@]/#/--ignore=}" "${SIDE[@]/#/--ignore=}" "${CHAINS[@]/#/--ignore=}" \
  -m "$marks" --junitxml="$shared/main.xml" "$@"
main=$(ran $?)
wait "$side_pid"
side=$(ran $?)
wait "$chains_pid"
chains=$(ran $?)
wait "$slurm_pid"
slurm=$(ran $?)
echo "========== ${SIDE[*]} (ran beside the rest) =========="
cat "$shared/side.log"
echo "========== ${CHAINS[*]} (ran beside the rest) =========="
cat "$shared/chains.log"
echo "========== ${SLURM[*]} (ran beside the rest) =========="
cat "$shared/slurm.log"
account
echo "pytest exit codes ($tier tier): the rest: $main; ${SIDE[*]}: $side; ${CHAINS[*]}: $chains;" \
  "${SLURM[*]}: $slurm"
for code in "$main" "$side" "$chains" "$slurm"; do
  [ "$code" -eq 0 ] || exit "$code"
done
