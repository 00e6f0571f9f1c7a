#!/usr/bin/env bash
# Peer libraries for benchmarks/throughput.py in their own venv (default .venv-bench), so the
# project's .venv is never modified: accelerate (for the HF Trainer runner), peft (Trainer +
# PEFT LoRA) and torchtitan.
# torch and transformers are pinned to the exact versions of the project's venv, so every
# runner uses the same kernels and the same LlamaForCausalLM; pip never swaps torch for
# another build (a CUDA wheel on a CPU machine, or the reverse).
# torchtitan's generation follows the torch and the device (benchmarks/peers/titan.py runs both):
# 0.3.0 on CUDA torch >= 2.12 (the newest; it imports DataParallelMeshDims from 2.12 and has no
# CPU path: flex attention has no CPU backward); 0.2.2 otherwise (torch 2.11, or a CPU build:
# its SDPA model runs on gloo). TORCHTITAN=x.y.z overrides.
#   bash benchmarks/setup_peers.sh            # VENV=.venv-bench MAIN_VENV=.venv TORCHTITAN=auto
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv-bench}
MAIN_VENV=${MAIN_VENV:-.venv}
PY=${PYTHON:-python3}

version() { "$MAIN_VENV/bin/python" -c "import $1; print($1.__version__)"; }
TORCH_VERSION=$(version torch)
TRANSFORMERS_VERSION=$(version transformers)
if [ "${TORCHTITAN:-auto}" = auto ]; then
  TORCHTITAN=$("$MAIN_VENV/bin/python" -c '
import torch
major, minor = (int(x) for x in torch.__version__.split("+")[0].split(".")[:2])
print("0.3.0" if torch.version.cuda and (major, minor) >= (2, 12) else "0.2.2")')
fi
echo "torchtitan $TORCHTITAN for torch $TORCH_VERSION"

[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
pip() { "$VENV/bin/python" -m pip "$@"; }

# The project's exact build; a local label pip cannot find here (+cuXXX from PyTorch's index)
# falls back to PyPI's build of the same version, which is the CUDA one; +cpu to PyTorch's CPU
# index (as scripts/install.sh does), never to PyPI's CUDA wheel.
if ! pip install -q "torch==$TORCH_VERSION"; then
  case "$TORCH_VERSION" in
    *+cpu) pip install -q "torch==$TORCH_VERSION" --index-url https://download.pytorch.org/whl/cpu ;;
    *) pip install -q "torch==${TORCH_VERSION%%+*}" ;;
  esac
fi
BENCH_TORCH=$("$VENV/bin/python" -c 'import torch; print(torch.__version__)')
CONSTRAINTS="$VENV/constraints.txt"
printf 'torch==%s\ntransformers==%s\n' "$BENCH_TORCH" "$TRANSFORMERS_VERSION" >"$CONSTRAINTS"
pip install -q -c "$CONSTRAINTS" "transformers==$TRANSFORMERS_VERSION" accelerate peft
# torchtitan may not resolve next to this torch; the benchmark then reports why it cannot run.
if ! pip install -q -c "$CONSTRAINTS" "torchtitan==$TORCHTITAN" 2>"$VENV/torchtitan-install.log"; then
  echo "torchtitan==$TORCHTITAN could not be installed (see $VENV/torchtitan-install.log)" >&2
fi
# torchtitan imports triton unconditionally; CUDA torch brings it, the CPU build does not.
# Installed here so that a CPU run reports torchtitan's real limit, not a missing import.
"$VENV/bin/python" -c "import triton" 2>/dev/null || pip install -q -c "$CONSTRAINTS" triton
"$VENV/bin/python" - <<'PY'
import importlib.metadata as md
for name in ("torch", "transformers", "accelerate", "peft", "torchtitan", "triton"):
    try:
        print(f"{name:13s} {md.version(name)}")
    except md.PackageNotFoundError:
        print(f"{name:13s} not installed")
PY
