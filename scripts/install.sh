#!/usr/bin/env bash
# Install llama_fsdp into a virtual environment (default .venv) with the right PyTorch build:
#   - torch already importable there: kept as is;
#   - an NVIDIA GPU (nvidia-smi works): the default PyPI wheel, which is the CUDA build;
#   - otherwise the CPU build: a local wheel if pip can find one (torch==X+cpu), else
#     PyTorch's CPU index. Never the multi-GB CUDA wheels on a machine without a GPU.
# Then the package itself: editable with its dev extras, or what LLAMA_FSDP_PACKAGE names (a wheel).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
TORCH_VERSION=${TORCH_VERSION:-2.13.0}
PY=${PYTHON:-python3}

[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
export PIP_DISABLE_PIP_VERSION_CHECK=1  # the install says what it did, not what pip could be
pip() { "$VENV/bin/python" -m pip "$@"; }
pip install -q --upgrade pip >/dev/null 2>&1 || true

if "$VENV/bin/python" -c "import torch" 2>/dev/null; then
  echo "torch $("$VENV/bin/python" -c 'import torch; print(torch.__version__)') already installed"
elif command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  echo "GPU found: installing the CUDA build of torch"
  pip install -q "torch>=2.11"
else
  echo "no GPU: installing the CPU build of torch"
  if ! pip install -q "torch==${TORCH_VERSION}+cpu" 2>/dev/null; then
    pip install -q torch --index-url https://download.pytorch.org/whl/cpu
    got=$("$VENV/bin/python" -c 'import torch; print(torch.__version__)')
    # said loudly: README.md's numbers are of TORCH_VERSION, and the test that holds them to
    # the default run skips on another build (and fails under CI: tests/conftest.py)
    cat >&2 <<EOF
################################################################################
WARNING: torch ${TORCH_VERSION}+cpu could not be installed; installed the newest CPU
torch instead: ${got}. README.md's numbers (the default run's summary) are of
${TORCH_VERSION}+cpu: this build may print others, and
tests/integration/test_local_run.py skips that check (under LLAMA_FSDP_CI=1 it fails).
To have ${TORCH_VERSION}: put its wheel where pip finds it, or run where the PyTorch
index answers, then: rm -rf ${VENV} && bash scripts/install.sh
################################################################################
EOF
  fi
fi
# torch is already satisfied, so this resolves the rest without touching it.
if [ -n "${LLAMA_FSDP_PACKAGE:-}" ]; then
  pip install -q "$LLAMA_FSDP_PACKAGE"
else
  # setuptools' note on every editable install ("Editable installation ... folders with the same
  # name as your package"): information for packagers, not for a user of this checkout
  QUIET_BUILD="ignore:Editable installation"
  PYTHONWARNINGS="$QUIET_BUILD" pip install -q -e ".[dev]"
fi
"$VENV/bin/python" -c "import torch, llama_fsdp; print('llama_fsdp ready: torch', torch.__version__, 'cuda' if torch.cuda.is_available() else 'cpu')"
