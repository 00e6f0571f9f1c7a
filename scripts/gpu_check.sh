#!/usr/bin/env bash
# The GPU check in one command (issue 42): on one H100 or H200, in at most 8 minutes, every
# result written to $OUT the moment it is known (docs/gpu.md: the device tool's run call, the
# carried wheels). Stages, each under its own time cap, in order of value: setup (the carried
# wheels installed, the imports checked, the machine), the default command, GPU tests,
# throughput against the peers, 8B QLoRA and LoRA, and what has landed since.
#
#   bash scripts/gpu_check.sh                            # on the GPU machine
#   DEVICE=cpu PY=.venv/bin/python bash scripts/gpu_check.sh   # the rehearsal on the CPU
#   python3 benchmarks/gpu_report.py $OUT/results.jsonl --out benchmarks/gpu.md
#
# Knobs (environment): benchmarks/gpu_check.py's docstring. PY: the python (python3, the
# image's, which has torch and transformers).
set -euo pipefail
cd "$(dirname "$0")/.."
exec "${PY:-python3}" benchmarks/gpu_check.py "$@"
