#!/usr/bin/env bash
# Thin wrapper: scripts/slurm_cluster.sh up|down|status|reap [options]  (see slurm_cluster.py)
#   eval "$(scripts/slurm_cluster.sh up --nodes 2)"   # brings it up and exports SLURM_CONF
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
py="$here/../.venv/bin/python"
[[ -x "$py" ]] || py="$(command -v python3)"
exec "$py" "$here/slurm_cluster.py" "$@"
