# snaketune: the two commands of the README, and a few helpers.
#
#   make demo      set up .venv and run the whole offline demo on the local profile
#   make test-all  set up .venv and run the whole test suite (what CI runs, 40 to 50 minutes on 2 cores)
#   make test      set up .venv and run the quick tier (every unit test and one shared demo
#                  pipeline, under 10 minutes): the check for every change

VENV ?= .venv
export PATH := $(CURDIR)/$(VENV)/bin:$(PATH)
export PYTHONWARNINGS := ignore::FutureWarning

.PHONY: setup demo test test-all test-bench bench lint clean

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

# Everything, in four pytest runs side by side (tests/run.sh all). The SLURM tests start a
# local cluster (tests/slurm/start.sh) from Debian's packages; without root they are skipped
# (CI sets SNAKETUNE_REQUIRE_SLURM=1: a skip fails there).
test-all: setup
	bash tests/slurm/install.sh || echo "note: SLURM packages not installed; tests/test_slurm.py will skip" >&2
	bash tests/run.sh all

# The short forms of the benchmarks that train or convert models (not in CI's full tier:
# docs/testing.md). Run it before recording a benchmark's figures or after changing bench/.
test-bench: setup
	bash tests/run.sh bench

bench: setup
	python bench/tokenize.py

lint: setup
	ruff check . && ruff format --check . && snakefmt --check Snakefile workflow && snakemake --lint

clean:
	rm -rf results resources logs benchmarks .snakemake
