#!/usr/bin/env bash
# The oldest transformers llama_fsdp supports (llama_fsdp/compat.py FLOORS, the GPU machines'
# release), overlaid on .venv, through the unit tests and the 1-vs-N-rank equivalence tests.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
FLOOR=$($PY -c 'from llama_fsdp.compat import FLOORS; print(".".join(map(str, FLOORS["transformers"])) + ".0")')
DIR=.floor/transformers-$FLOOR
if [ ! -d "$DIR" ]; then
  # exactly what pip would change in .venv to have that release, installed beside it instead
  report=$(mktemp)
  $PY -m pip install -q --dry-run --report "$report" "transformers==$FLOOR"
  pkgs=$($PY - "$report" <<'PY'
import json, sys
meta = [i["metadata"] for i in json.load(open(sys.argv[1]))["install"]]
print(" ".join(f"{m['name']}=={m['version']}" for m in meta))
PY
)
  $PY -m pip install -q --no-deps --target "$DIR" $pkgs
fi
export PYTHONPATH="$PWD/$DIR"
$PY -c 'import transformers; print("transformers", transformers.__version__, "from", transformers.__file__)'
$PY -m pytest -q -p no:cacheprovider -n 2 --dist loadscope tests/unit tests/multirank/test_fsdp.py
