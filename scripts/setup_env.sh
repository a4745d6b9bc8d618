#!/usr/bin/env bash
# Create (or update) the project's virtual environment in .venv and install the stack.
#
#   bash scripts/setup_env.sh            # runtime stack, lm-eval and bitsandbytes (eval, qlora extras), dev tools
#
# torch: on a machine with an NVIDIA driver (nvidia-smi answers) pip installs torch==2.13.0
# from PyPI, which is the CUDA build. Without one it installs the same version, and pip
# prefers a local CPU wheel (2.13.0+cpu) when one is offered through --find-links or an
# index. Set TORCH_INDEX_URL to force another build (a CPU-only or ROCm index), or
# SNAKETUNE_VENV to put the environment elsewhere.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${SNAKETUNE_VENV:-.venv}
PY=${PYTHON:-python3}
TORCH_VERSION=$(sed -n 's/^ *"torch==\([^"]*\)",*$/\1/p' pyproject.toml)

[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
# (the grep hides pip warnings about index mirrors configured on some machines but absent)
pip_install() {
  "$VENV/bin/python" -m pip install --disable-pip-version-check -q "$@" 2> >(grep -v "^WARNING: Location" >&2)
}

if "$VENV/bin/python" -c "import torch, sys; sys.exit(torch.__version__.split('+')[0] != '$TORCH_VERSION')" 2>/dev/null; then
  echo "torch $TORCH_VERSION already installed"
elif [ -n "${TORCH_INDEX_URL:-}" ]; then
  pip_install "torch==$TORCH_VERSION" --index-url "$TORCH_INDEX_URL"
elif command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  echo "NVIDIA GPU found: installing the CUDA build of torch $TORCH_VERSION"
  pip_install "torch==$TORCH_VERSION"
else
  echo "no NVIDIA GPU: installing torch $TORCH_VERSION (local CPU wheel when offered)"
  pip_install "torch==$TORCH_VERSION"
fi

# Headless Chromium renders the HTML report in the tests (Debian's package; root only).
if ! command -v chromium >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "installing chromium (report rendering test)"
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null
  else
    echo "note: chromium not found; tests/test_evaluate.py renders the report with it" >&2
  fi
fi

# The rest of the stack. torch is already satisfied, so nothing pulls another build.
# DeepSpeed ships as an sdist; its ops are JIT-compiled on first use.
pip_install -e ".[dev,eval,qlora]"
"$VENV/bin/python" -c "import torch; print('torch', torch.__version__, 'cuda' if torch.cuda.is_available() else 'cpu')"
# Without a GPU, DeepSpeed's CPU collective op is compiled (about 30 s) the first time a
# training starts; compile it here once, into this environment's own extension cache
# (snaketune.core.cache.extensions_dir: the train jobs use the same), instead.
if "$VENV/bin/python" -c "import torch, sys; sys.exit(torch.cuda.is_available())"; then
  echo "building DeepSpeed's CPU communication op (once)"
  # (with the environment's own ninja first on PATH, as the jobs run it: a build by another
  # ninja version, whose log it cannot read, is built again by the next)
  TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-$("$VENV/bin/python" -c \
    "from snaketune.core.cache import extensions_dir; print(extensions_dir())")} \
  PATH="$(cd "$VENV/bin" && pwd):$PATH" PYTHONWARNINGS=ignore "$VENV/bin/python" -c "
from deepspeed.ops.op_builder.cpu import ShareMemCommBuilder
ShareMemCommBuilder().load(verbose=False)" >/dev/null
fi
