#!/usr/bin/env bash
# One GPU session's measurements, a stage per command, for a machine that has python3 with
# CUDA torch and transformers but cannot download (the device tool's image: 10 minutes per
# command, 30 minutes in all). Build the wheelhouses here first (network):
#   bash scripts/offline_wheels.sh .whl 3.12 .whl-bench
# then on the GPU machine, from the repository root, one stage per command:
#   bash scripts/gpu_session.sh tests       # the GPU test suite (pytest -m gpu tests/gpu); or
#   bash scripts/gpu_session.sh tests tests/gpu/test_gpu_run.py   # one file per command: the
#                                           # whole suite may outlast one 600 s command
#   bash scripts/gpu_session.sh bench       # 1b, seq 2048, mixed: llama_fsdp vs the floor, HF Trainer, torchtitan
#   bash scripts/gpu_session.sh attention   # the same shape: varlen (auto) vs SDPA's dense block mask vs unpacked
#   bash scripts/gpu_session.sh compile     # the same shape: train.compile=true vs false
#   bash scripts/gpu_session.sh 8b          # 8b, full activation checkpointing, bf16, one device: plan, then a run
#   bash scripts/gpu_session.sh optim       # 8b with 8-bit AdamW moments on one device: plan, then its peak vs the plan
#   bash scripts/gpu_session.sh finetune    # lora / qlora: tests/gpu/test_gpu_adapters.py, then 8b lora and qlora runs
# Everything it reports goes to $OUT (the device tool returns that folder; default
# outputs/gpu-session). Knobs (env): PY (python3), DEVICE (cuda; cpu runs a stage's commands
# on this machine, with MODEL=tiny SEQ=128, to check the script itself), MODEL (1b), SEQ (2048),
# BATCH (4, per rank), PRECISION (mixed), ROUNDS (2), STEPS (30), RANKS (1).
set -euo pipefail
cd "$(dirname "$0")/.."
STAGE=${1:?"stage: tests | bench | attention | compile | 8b | optim | finetune"}
shift
PY=${PY:-python3}
OUT=${OUT:-outputs/gpu-session}
DEVICE=${DEVICE:-cuda}
MODEL=${MODEL:-1b}
SEQ=${SEQ:-2048}
BATCH=${BATCH:-4}
PRECISION=${PRECISION:-mixed}
ROUNDS=${ROUNDS:-2}
STEPS=${STEPS:-30}
RANKS=${RANKS:-1}
mkdir -p "$OUT"

# The project's pure dependencies from the carried wheelhouse, and for the bench stage
# torchtitan's, unless this python has them already.
if ! "$PY" -c "import hydra, omegaconf, mlflow, submitit, datasets, torchao" 2>/dev/null; then
  [ -d .whl ] || { echo ".whl is missing: build it with scripts/offline_wheels.sh and carry it" >&2; exit 2; }
  "$PY" -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
if [ "$STAGE" = bench ] && [ -d .whl-bench ] && ! "$PY" -c "import torchtitan" 2>/dev/null; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --target /tmp/site-bench .whl-bench/*.whl
  export PYTHONPATH=/tmp/site-bench:$PYTHONPATH
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
# the peers run on the same interpreter: a "venv" whose bin/python execs this python (a
# wrapper, not a symlink: an interpreter that is itself a venv's finds its pyvenv.cfg, and so
# its site-packages, only from its own path)
PY_PATH=$(command -v "$PY")
case "$PY_PATH" in /*) ;; *) PY_PATH=$PWD/$PY_PATH ;; esac
BENCH_VENV=/tmp/gpu-session-venv
mkdir -p "$BENCH_VENV/bin"
rm -f "$BENCH_VENV/bin/python"
printf '#!/bin/sh\nexec "%s" "$@"\n' "$PY_PATH" > "$BENCH_VENV/bin/python"
chmod +x "$BENCH_VENV/bin/python"

{ date -u; command -v nvidia-smi >/dev/null && nvidia-smi || echo "no nvidia-smi"
  "$PY" -c "import importlib.metadata as m
for n in ('torch', 'transformers', 'accelerate', 'torchtitan', 'hydra-core', 'mlflow-skinny', 'datasets', 'torchao'):
    try: print(n, m.version(n))
    except m.PackageNotFoundError: print(n, 'not installed')"
} > "$OUT/machine-$STAGE.txt" 2>&1

# The synthetic task's own tokenizer (512 pieces) is refused by a model of another vocabulary
# size (a sign that a model's own tokenizer was not found); named as data.tokenizer, it is a
# tokenizer smaller than the embedding, which a pretrained model may have. Token ids then span
# 512 of the vocabulary: the embedding gather and the full-vocabulary output layer and loss cost
# the same for any ids.
TOKENIZER=/tmp/gpu-session-tokenizer
"$PY" - "$TOKENIZER" <<'PYTHON'
import sys
from pathlib import Path

from llama_fsdp.config import DataConfig
from llama_fsdp.data import build_tokenizer

build_tokenizer(DataConfig(), Path("/tmp/gpu-session-cache")).save_pretrained(sys.argv[1])
PYTHON

bench() {  # bench NAME RUNNERS [throughput.py args...]
  local name=$1 runners=$2; shift 2
  local tok=()
  [ "$MODEL" = tiny ] || tok=(--framework-override "data.tokenizer=$TOKENIZER")
  "$PY" benchmarks/throughput.py --device "$DEVICE" --ranks "$RANKS" --model "$MODEL" \
    --seq-len "$SEQ" --batch-size "$BATCH" --precision "$PRECISION" --rounds "$ROUNDS" \
    --steps "$STEPS" --runners "$runners" --bench-venv "$BENCH_VENV" --run-timeout 280 \
    --work-dir "/tmp/gpu-session-$name" --out "$OUT/throughput-$name.md" "${tok[@]}" "$@" \
    2>&1 | tee "$OUT/throughput-$name.log"
  # each run's own logs (MFU, memory, torchtitan's lines) next to the table
  tar -czf "$OUT/runs-$name.tgz" -C /tmp "gpu-session-$name" 2>/dev/null || true
}

case "$STAGE" in
  tests)
    name=gpu-tests${1:+-$(basename "${1%.py}")}
    "$PY" -m pytest -q -m gpu "${@:-tests/gpu}" -rA --durations=0 2>&1 | tee "$OUT/$name.txt" ;;
  bench)
    # llama_fsdp packs the synthetic task's short records (~200 per 2048-token row, so its
    # attention does less work than a causal row); llama_fsdp_unpacked is one record per row,
    # right-padded: full causal rows, the peers' work
    bench "$MODEL-s$SEQ" llama_fsdp_unpacked,bare_fsdp2,hf_trainer,torchtitan,llama_fsdp ;;
  attention)
    bench "$MODEL-s$SEQ-attention" llama_fsdp,llama_fsdp_sdpa,llama_fsdp_unpacked,bare_fsdp2_packed ;;
  compile)
    bench "$MODEL-s$SEQ-eager" llama_fsdp
    bench "$MODEL-s$SEQ-compiled" llama_fsdp --framework-override train.compile=true ;;
  8b)
    # AdamW with fp32 master weights holds 16 bytes per parameter (128 GB for 8B) before any
    # activation, so only precision=bf16 (8 bytes) can fit one device. The planner's verdict
    # comes first; a refused plan is run anyway (force=true) to set the plan against CUDA's
    # measured peak (the bare loop has no activation checkpointing and is not run here).
    P8=${PRECISION_8B:-bf16}
    "$PY" -m llama_fsdp model=8b checkpointing=full precision="$P8" \
      cluster.device="$DEVICE" cluster.nproc_per_node="$RANKS" train.batch_size="${BATCH_8B:-1}" \
      train.seq_len="$SEQ" tracking.enabled=false hydra.run.dir=/tmp/gpu-session-8b-plan \
      dry_run=true 2>&1 | tee "$OUT/plan-8b-full-ac.txt"
    force=()
    if grep -q "would be refused" "$OUT/plan-8b-full-ac.txt"; then
      echo "the planner refuses 8b with full activation checkpointing on $RANKS device(s) here; running it anyway (force=true) to measure" \
        | tee -a "$OUT/plan-8b-full-ac.txt"
      force=(--framework-override force=true)
    fi
    MODEL=8b BATCH=${BATCH_8B:-1} PRECISION=$P8 ROUNDS=1 STEPS=${STEPS_8B:-12} \
      bench "8b-s$SEQ-full-ac-$P8" llama_fsdp --framework-override checkpointing=full "${force[@]}" ;;
  optim)
    # 8b, bf16, full activation checkpointing, micro-batch 1, 8-bit AdamW moments on one device:
    # the plan (AdamW's bf16 moments do not fit 80 GB, 8-bit ones do), then the measured peak
    # of real steps against it (tests/gpu/test_gpu_optim.py; the first step compiles the
    # optimizer's step)
    "$PY" -m llama_fsdp model=8b checkpointing=full precision=bf16 optim=adamw8bit \
      cluster.device="$DEVICE" cluster.nproc_per_node=1 train.batch_size=1 train.seq_len="$SEQ" \
      tracking.enabled=false hydra.run.dir=/tmp/gpu-session-optim-plan dry_run=true 2>&1 \
      | tee "$OUT/plan-8b-adamw8bit.txt"
    "$PY" -m pytest -q -m gpu tests/gpu/test_gpu_optim.py -rA -s --durations=0 2>&1 \
      | tee "$OUT/gpu-tests-optim.txt" ;;
  finetune)
    # LoRA / QLoRA: the GPU tests (QLoRA bf16 + compile; CUDA peak against the plan), then 8b
    # lora and qlora (random init) on one device, full AC, micro-batch 1: the plan, then a run
    # whose summary sets the measured peak beside it
    "$PY" -m pytest -q -m gpu tests/gpu/test_gpu_adapters.py -rA --durations=0 2>&1 \
      | tee "$OUT/gpu-tests-adapters.txt"
    for method in lora qlora; do
      MODEL=8b BATCH=1 PRECISION=${PRECISION_FT:-bf16} ROUNDS=1 STEPS=${STEPS_FT:-12} \
        bench "8b-s$SEQ-$method" llama_fsdp --framework-override finetune=$method \
        --framework-override checkpointing=full
    done ;;
  *)
    echo "unknown stage '$STAGE': tests | bench | attention | compile | 8b | optim | finetune" >&2; exit 2 ;;
esac
echo "stage $STAGE done; results in $OUT"
