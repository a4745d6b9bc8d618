# snaketune: the two commands of the README, and a few helpers.
#
#   make demo          set up .venv and run the whole offline demo on the local profile
#   make test-ci       set up .venv and run the CI tier (what .ci/run runs: the quick tier and one
#                      end-to-end test of every capability, chains short)
#   make test          the quick tier (unit tests and one shared demo pipeline): every change
#   make test-touched  the extended tests whose code your change touches (BASE=rev, default HEAD)
#   make test-extended the extended tier (documented lengths, each chain's faults, benchmarks)
#   make test-all      every tier: ci, extended, bench
#   make mutants       mutation testing (MODULES="scripts/snaketune/..." or those changed since
#                      BASE): each module's survivors under mutants/ (not in CI)
# Timings of each: docs/testing.md.

VENV ?= .venv
export PATH := $(CURDIR)/$(VENV)/bin:$(PATH)
export PYTHONWARNINGS := ignore::FutureWarning

.PHONY: setup demo test test-ci test-extended test-touched test-all test-bench bench lint clean mutants

setup: $(VENV)/.installed

# Reinstall when the pins or the setup script change.
$(VENV)/.installed: pyproject.toml scripts/setup_env.sh
	bash scripts/setup_env.sh
	touch $@

demo: setup
	snakemake --profile profiles/local

# The quick tier: -m "not slow" (tests/run.sh quick).
test: setup
	bash tests/run.sh quick

# The CI tier (tests/run.sh ci): -m "not extended and not bench", in four pytest runs side by
# side. The SLURM tests start a local cluster (tests/slurm/start.sh) from Debian's packages;
# without root they are skipped (CI sets SNAKETUNE_REQUIRE_SLURM=1: a skip fails there).
test-ci: setup
	bash tests/slurm/install.sh || echo "note: SLURM packages not installed; tests/test_slurm.py will skip" >&2
	bash tests/run.sh ci

# The extended tier (-m extended), and the extended tests a change touches (tests/touched.py:
# from the map of which library modules each test's processes load).
test-extended: setup
	bash tests/slurm/install.sh || echo "note: SLURM packages not installed; tests/test_slurm.py will skip" >&2
	bash tests/run.sh extended

BASE ?= HEAD
test-touched: setup
	bash tests/run.sh touched --base $(BASE)

# Every tier: ci, then extended, then bench.
test-all: setup
	bash tests/slurm/install.sh || echo "note: SLURM packages not installed; tests/test_slurm.py will skip" >&2
	bash tests/run.sh all

# The short forms of the benchmarks that train or convert models (marker bench). Run it
# before recording a benchmark's figures or after changing bench/.
test-bench: setup
	bash tests/run.sh bench

# Mutation testing (tests/mutate.py): MODULES="scripts/snaketune/data/chat.py ..." or, without
# them, the library modules changed since BASE (default HEAD: what is not committed yet).
mutants: setup
	python tests/mutate.py $(if $(MODULES),$(MODULES),--base $(BASE)) $(if $(TESTS),--tests $(TESTS))

bench: setup
	python bench/tokenize.py

lint: setup
	ruff check . && ruff format --check . && snakefmt --check Snakefile workflow && snakemake --lint

clean:
	rm -rf results resources logs benchmarks .snakemake
