#!/usr/bin/env bash
# The GPU machines' stack on this CPU: the oldest torch and transformers llama_fsdp supports
# (llama_fsdp/compat.py FLOORS: torch 2.11 and transformers 5.17, the GPU image's releases),
# overlaid on .venv, through the unit tests, the multi-rank tests (FSDP2 sharding and DDP, DCP
# checkpoints and HF loading, NF4 under fully_shard, torchao's low-bit moments, mixed precision,
# activation checkpointing and compile) and the default command end to end. CI installs newer
# releases; this is what keeps the GPU machines' stack working between GPU sessions.
#
# torch 2.11 comes from PyPI, where Linux wheels are the CUDA build: about 2.6 GB with its
# NVIDIA libraries, unpacked once into .floor/ (4.6 GB). It runs on the CPU here
# (torch.cuda.is_available() is false).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
read -r TORCH TRANSFORMERS < <($PY -c 'from llama_fsdp.compat import FLOORS
print(*(".".join(map(str, FLOORS[n])) + ".0" for n in ("torch", "transformers")))')
PINS=("torch==$TORCH" "transformers==$TRANSFORMERS")
DIR=.floor/torch-$TORCH-transformers-$TRANSFORMERS
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
# the multi-rank tests but the planned-against-measured memory sweep (5 min of spawned ranks; it
# passed on 2.11 by hand, and the GPU session measures the plan against CUDA), and the default
# command end to end
$PY -m pytest -q -p no:cacheprovider -n 2 --dist loadscope tests/unit tests/multirank \
  --ignore=tests/multirank/test_plan_memory.py tests/integration/test_local_run.py
