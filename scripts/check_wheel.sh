#!/usr/bin/env bash
# The package as a user installs it: build the wheel, check it claims one top-level name and
# carries its config groups, install it into a fresh venv, and run the command from an empty
# directory (console script and python -m).
set -euo pipefail
cd "$(dirname "$0")/.."
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
.venv/bin/python -m pip wheel -q --no-deps . -w "$work/dist"
wheel=$(ls "$work"/dist/llama_fsdp-*.whl)
.venv/bin/python - "$wheel" <<'PY'
import sys, zipfile
names = zipfile.ZipFile(sys.argv[1]).namelist()
tops = sorted({n.split("/")[0] for n in names})
# llama_fsdp, and its Hydra sweeper where Hydra finds plugins (hydra_plugins is Hydra's
# namespace: the wheel must not own its __init__.py)
assert tops == ["hydra_plugins", "llama_fsdp",
                next(t for t in tops if t.endswith(".dist-info"))], tops
assert "hydra_plugins/__init__.py" not in names
for need in ("llama_fsdp/conf/config.yaml", "llama_fsdp/conf/model/tiny.yaml",
             "llama_fsdp/conf/experiment/llama3_1b_alpaca.yaml", "llama_fsdp/launchers/rank.py",
             "hydra_plugins/llama_fsdp_sweeper/optuna_sweeper.py"):
    assert need in names, need
# every package of the checkout is in the wheel (pyproject lists them by hand)
import pathlib
for init in sorted(pathlib.Path("llama_fsdp").rglob("__init__.py")):
    assert init.as_posix() in names, f"{init.parent} is not in the wheel: add it to pyproject.toml's packages"
print(f"wheel: {len(names)} files under {tops}")
PY
VENV="$work/venv" LLAMA_FSDP_PACKAGE="$wheel" bash scripts/install.sh
empty=$(mktemp -d)
(cd "$empty" && "$work/venv/bin/llama-fsdp" dry_run=true cluster.device=cpu | tail -1)
(cd "$empty" && "$work/venv/bin/python" -m llama_fsdp model=8b cluster=slurm cluster.gpus_per_node=8 \
    cluster.device=cuda dry_run=true 2>&1 | grep -q "#SBATCH --ntasks-per-node=8")
# Hydra's own plugin discovery (what a wheel install relies on) finds the search's sweeper
(cd "$empty" && "$work/venv/bin/python" -c 'from hydra.core.plugins import Plugins
from hydra.plugins.sweeper import Sweeper
found = [c.__name__ for c in Plugins.instance().discover(Sweeper)]
assert "OptunaSweeper" in found, found')
test -z "$(ls -A "$empty")" || { echo "a dry run left files in $empty"; ls -R "$empty"; exit 1; }
echo "wheel OK: installed, llama-fsdp and python -m llama_fsdp run from an empty directory"
