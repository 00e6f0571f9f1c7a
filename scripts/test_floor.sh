#!/usr/bin/env bash
# The GPU machines' stack on this CPU: the oldest torch and transformers llama_fsdp supports
# (llama_fsdp/versions.py FLOORS: torch 2.11 and transformers 5.17, the GPU image's releases), and
# the torchao the project carries to that image as a wheel (the image has none:
# scripts/offline_wheels.sh pins it), overlaid on .venv, through the tests whose behaviour
# depends on those releases (FSDP2 sharding and DDP, DCP checkpoints and HF loading, NF4 under
# fully_shard, torchao's low-bit moments, mixed precision, activation checkpointing and compile,
# transformers' model and tokenizers) and one run of each kind end to end, with torchrun's agent
# (tests/conftest.py FLOOR_TESTS). CI installs newer releases; this is what keeps the GPU machines'
# stack working between GPU sessions.
#
# torch 2.11 comes from PyPI, where Linux wheels are the CUDA build: about 2.6 GB with its
# NVIDIA libraries, unpacked once into .floor/ (4.6 GB). It runs on the CPU here
# (torch.cuda.is_available() is false).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
read -r TORCH TRANSFORMERS < <($PY -c 'from llama_fsdp.versions import FLOORS
print(*(".".join(map(str, FLOORS[n])) + ".0" for n in ("torch", "transformers")))')
# the one torchao release the offline wheelhouse ships (it loads its kernels on torch >= 2.11)
TORCHAO=$(sed -n 's/^ *torchao==\([0-9.]*\)$/\1/p' scripts/offline_wheels.sh)
[ -n "$TORCHAO" ] || { echo "no torchao==X pin in scripts/offline_wheels.sh" >&2; exit 2; }
PINS=("torch==$TORCH" "transformers==$TRANSFORMERS" "torchao==$TORCHAO")
DIR=.floor/torch-$TORCH-transformers-$TRANSFORMERS-torchao-$TORCHAO
if [ ! -f "$DIR/.complete" ]; then
  rm -rf "$DIR"
  # exactly what pip would change in .venv to have those releases, installed beside it instead
  report=$(mktemp)
  $PY -m pip install -q --dry-run --report "$report" "${PINS[@]}"
  pkgs=$($PY - "$report" <<'PY'
import json, sys
meta = [i["metadata"] for i in json.load(open(sys.argv[1]))["install"]]
print(" ".join(f"{m['name']}=={m['version']}" for m in meta))
PY
)
  $PY -m pip install -q --no-deps --target "$DIR" $pkgs
  touch "$DIR/.complete"
fi
export PYTHONPATH="$PWD/$DIR"
# the skips of another torch than the README's are allowed here only (tests/conftest.py)
export LLAMA_FSDP_FLOOR=1
# the overlay is what runs, not .venv's releases
$PY - "${PINS[@]}" <<'PY'
import importlib, importlib.metadata as md, sys
for pin in sys.argv[1:]:
    name, want = pin.split("==")
    mod = importlib.import_module(name)
    have = md.version(name)
    print(name, have, "from", mod.__file__)
    assert have == want and mod.__version__.split("+")[0] == want, (name, have, want)
PY
# the tests whose behaviour depends on these releases, and one run of each kind end to end
# (tests/conftest.py FLOOR_TESTS says which, and why each)
$PY -m pytest -q -p no:cacheprovider -n 2 --dist loadscope -m floor tests/
