#!/usr/bin/env bash
# What the planned-against-measured memory test (tests/multirank/test_plan_memory.py) needs from
# Debian: a C compiler for its malloc shim (benchmarks/plan_vs_measured.build_memtrack).
# Idempotent; needs root to install.
set -euo pipefail
if command -v cc >/dev/null 2>&1; then
    exit 0
fi
if [[ $(id -u) -ne 0 ]]; then
    echo "cc_deps.sh: must run as root (apt-get install gcc)" >&2
    exit 1
fi
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq >/dev/null
apt-get install -y -qq --no-install-recommends gcc libc6-dev >/dev/null
echo "cc_deps.sh: installed $(cc --version | head -1)"
