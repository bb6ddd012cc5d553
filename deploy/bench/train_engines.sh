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
# Paths: TRAIN (dflash-train), CHECK (gpu_check), OUT (results dir). Optional: BATCH (default 4),
# STEPS (default 12), ENGINES (default "explicit autograd"), TLIM per run (default 150 s).
# DFLASH_TESTS_DIR must point at the repository's tests/ for gpu_check. Run from the
# repository root.
set -u
: "${TRAIN:?path to dflash-train}" "${CHECK:?path to gpu_check}" "${OUT:?results dir}"
BATCH=${BATCH:-4}; STEPS=${STEPS:-12}; TLIM=${TLIM:-150}
T0=$(date +%s); el() { echo $(( $(date +%s) - T0 )); }
mkdir -p "$OUT"
timeout "$TLIM" "$CHECK" cuda "$OUT/explicit.json" --train-explicit > "$OUT/explicit.log" 2>&1
echo "gpu_check --train-explicit rc=$? at $(el) s"
grep '^explicit_' "$OUT/explicit.log" | cut -c1-700
for engine in ${ENGINES:-explicit autograd}; do
  run=/tmp/train-engine-$engine
  rm -rf "$run"
  nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -lms 200 > "$OUT/mem_$engine.txt" &
  smi=$!
  timeout "$TLIM" "$TRAIN" train --target-model random:qwen3-8b --num-draft-layers 5 --block-size 16 \
    --num-anchors 512 --target-devices cuda:0 --drafter-device cuda:0 --max-steps 100000 \
    --grad-accum 1 --dataset synthetic:len=2048,n=5000 --max-len 2048 --batch-size "$BATCH" \
    --stop-after-steps "$STEPS" --log-every $(( STEPS / 2 )) --save-every 100000 \
    --train-engine "$engine" --output-dir "$run" > "$OUT/train_$engine.log" 2>&1
  rc=$?; kill $smi
  echo "8B $engine batch $BATCH rc=$rc at $(el) s peak_mem_mib=$(sort -n "$OUT/mem_$engine.txt" | tail -1)"
  grep '"kind":"window"' "$run/metrics.jsonl" > "$OUT/window_$engine.jsonl" 2>/dev/null
  tail -n 1 "$OUT/window_$engine.jsonl" | cut -c1-400
  [ $rc -eq 0 ] || tail -n 5 "$OUT/train_$engine.log" | cut -c1-300
  rm -rf "$run"
done
