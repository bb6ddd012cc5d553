#!/usr/bin/env bash
# Issue 18: the explicit training engine against candle's autograd on one GPU, in one device call.
#
#   1. `gpu_check cuda OUT/explicit.json --train-explicit`: gradients of the explicit step against
#      autograd (f32 within 1e-4, bf16 against the f32 reference) and both engines' forward +
#      backward time and held memory at the tiny and 8B recipes' drafter shapes.
#   2. The 8B recipe (Qwen3-8B-shaped random target, 5-layer drafter, 2048-token sequences, 512
#      anchors, batch BATCH) under each engine for STEPS optimizer steps: the trainer's window
#      lines (sequence tokens/s, drafter and target time per step) and nvidia-smi's peak memory.
#
#   With SWEEP=1 instead: the 8B recipe under ENGINES (default explicit) for every sequence length
#   in LENS (default "2048 3072 4096") x batch in BATCHES (default "1 2 4"), SWEEP_STEPS (default 4)
#   steps each: the window line (tokens/s, drafter / target time per step, MFU) and peak memory
#   of each, an OOM reported as such.
#
# Paths: TRAIN (dflash-train), CHECK (gpu_check), OUT (results dir). Optional: BATCH (default 4),
# STEPS (default 12), ENGINES (default "explicit autograd"), TLIM per run (default 150 s).
# DFLASH_TESTS_DIR must point at the repository's tests/ for gpu_check. Run from the
# repository root.
set -u
: "${TRAIN:?path to dflash-train}" "${CHECK:?path to gpu_check}" "${OUT:?results dir}"
BATCH=${BATCH:-4}; STEPS=${STEPS:-12}; TLIM=${TLIM:-150}
T0=$(date +%s); el() { echo $(( $(date +%s) - T0 )); }
mkdir -p "$OUT"
# One run of the 8B recipe: engine, sequence length, batch, steps.
recipe() {
  local engine=$1 len=$2 batch=$3 steps=$4 tag="$1-$2x$3" run=/tmp/train-engine-run
  rm -rf "$run"
  nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -lms 200 > "$OUT/mem_$tag.txt" &
  local smi=$!
  timeout "$TLIM" "$TRAIN" train --target-model random:qwen3-8b --num-draft-layers 5 --block-size 16 \
    --num-anchors 512 --target-devices cuda:0 --drafter-device cuda:0 --max-steps 100000 \
    --grad-accum 1 --dataset "synthetic:len=$len,n=5000" --max-len "$len" --batch-size "$batch" \
    --stop-after-steps "$steps" --log-every $(( steps / 2 )) --save-every 100000 \
    --train-engine "$engine" --output-dir "$run" > "$OUT/train_$tag.log" 2>&1
  local rc=$?; kill $smi
  echo "8B $engine len $len batch $batch rc=$rc at $(el) s peak_mem_mib=$(sort -n "$OUT/mem_$tag.txt" | tail -1)"
  grep '"kind":"window"' "$run/metrics.jsonl" > "$OUT/window_$tag.jsonl" 2>/dev/null
  tail -n 1 "$OUT/window_$tag.jsonl" | cut -c1-400
  [ $rc -eq 0 ] || grep -m1 -i "out of memory\|error" "$OUT/train_$tag.log" | cut -c1-300
  rm -rf "$run"
}
if [ "${SWEEP:-0}" = 1 ]; then
  for engine in ${ENGINES:-explicit}; do
    for len in ${LENS:-2048 3072 4096}; do
      for batch in ${BATCHES:-1 2 4}; do recipe "$engine" "$len" "$batch" "${SWEEP_STEPS:-4}"; done
    done
  done
  exit 0
fi
timeout "$TLIM" "$CHECK" cuda "$OUT/explicit.json" --train-explicit > "$OUT/explicit.log" 2>&1
echo "gpu_check --train-explicit rc=$? at $(el) s"
grep '^explicit_' "$OUT/explicit.log" | cut -c1-700
for engine in ${ENGINES:-explicit autograd}; do recipe "$engine" 2048 "$BATCH" "$STEPS"; done
