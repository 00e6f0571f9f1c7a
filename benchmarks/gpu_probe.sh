#!/usr/bin/env bash
# GPU diagnosis after the 2026-11-26 21:25 check (benchmarks/gpu.md), in one device call:
#   1. llama_fsdp at 1b, seq 2048, rows of one 2048-token record (what the peers train on),
#      compiled with the fused AdamW step, packed (varlen attention); unpacked (SDPA causal) last;
#   2. where 8B QLoRA's peak at 16,384 tokens goes (the plan missed it by 24%): the allocator's
#      history over step 2, live allocations at the peak by site (memory_probe.py);
#   3. attention kernels at the 1b shape, rows of one record and of many (attention_gpu.py).
# Every result is written to $OUT as it comes. DEVICE=cpu rehearses it with tiny shapes.
#   OUT=... bash benchmarks/gpu_probe.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-outputs/gpu-probe}; WORK=${WORK:-/tmp/gpu-probe}; PY=${PY:-python3}
DEVICE=${DEVICE:-cuda}
mkdir -p "$OUT" "$WORK"
if [ "$DEVICE" = cuda ] && ls .whl/*.whl >/dev/null 2>&1; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$WORK/site" .whl/*.whl
fi
export PYTHONPATH="$PWD:$WORK/site${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
if [ "$DEVICE" = cuda ]; then
  BIG="model=8b train.seq_len=16384"; ONE="model=1b train.seq_len=2048 train.batch_size=4"
  DEV="cluster.nproc_per_node=1"; STEPS=20; RECORD_CHARS=3000
else
  BIG="model=tiny train.seq_len=256"; ONE="model=tiny train.seq_len=128 train.batch_size=2"
  DEV="cluster.device=cpu cluster.nproc_per_node=1 optim.fused=false"; STEPS=4; RECORD_CHARS=900
fi
"$PY" -c "import sys; from llama_fsdp.config.schema import DataConfig; from llama_fsdp.data import build_tokenizer; build_tokenizer(DataConfig(), sys.argv[1] + '/cache').save_pretrained(sys.argv[1] + '/tokenizer')" "$WORK"
COMMON="data.tokenizer=$WORK/tokenizer eval.every_steps=0 eval.task_prompts=0 save.every_steps=0 tracking.enabled=false resume=none"
stamp() { echo "[probe $(date +%T)] $*" | tee -a "$OUT/probe.log"; }



"$PY" -c "import sys; sys.path.insert(0, 'benchmarks'); from gpu_check_stages import write_long_texts; write_long_texts(__import__('pathlib').Path(sys.argv[1]), 400, chars=int(sys.argv[2]))" "$WORK/long.jsonl" "$RECORD_CHARS"
one_record() {
  variant=$1
  stamp "one record per row: $variant"
  timeout -k 5 90 "$PY" -m llama_fsdp $ONE precision=mixed checkpointing=none \
    train.max_steps=$STEPS train.warmup_steps=1 train.compile=true optim.fused=true data=jsonl \
    data.path="$WORK/long.jsonl" data.eval_fraction=0 $variant $COMMON $DEV \
    hydra.run.dir="$WORK/one-packing-${variant##*=}" > "$WORK/run.log" 2>&1
  code=$?
  { echo "=== $variant: exit $code"; grep -E "attention|data:|tokens/s|peak memory|status|Error|error" "$WORK/run.log" | tail -20; } >> "$OUT/one_record.log"
  cp "$WORK/run.log" "$OUT/run_packing_${variant##*=}.log"
  stamp "$variant: exit $code"
}
one_record data.packing=true
stamp memory probe
MEMORY_PROBE_OUT="$OUT/memory_probe.json" timeout -k 5 110 "$PY" -m llama_fsdp $BIG \
  finetune=qlora precision=bf16 checkpointing=full train.batch_size=1 train.max_steps=2 \
  train.warmup_steps=1 $COMMON $DEV output_dir="$WORK/probe" \
  'train.callbacks=["benchmarks.memory_probe:MemoryProbe"]' > "$OUT/memory_probe.log" 2>&1
stamp "memory probe: exit $?"
stamp attention
timeout -k 5 50 "$PY" benchmarks/attention_gpu.py --out "$OUT/attention.jsonl" --device "$DEVICE" \
  > "$OUT/attention.log" 2>&1; stamp "attention: exit $?"
one_record data.packing=false
stamp done
