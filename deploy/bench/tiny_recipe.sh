#!/usr/bin/env bash
# Issue 18's tiny-recipe comparison on one GPU, in phases (one device call cannot hold them all):
#
#   PHASE=regen  the data: `dflash-train regenerate` of the first 3,000 records of
#                ../shared/fixtures/corpus/train.jsonl.xz (greedy, 384 new tokens, tiny-coder-demo
#                with its demo drafter, batches of 32), resumable: rerun until it reports done.
#   PHASE=train  one run of the recipe: tiny-coder-demo target, 2-layer drafter, taps 0,1,2,
#                block 16, 256 anchors, batch 32, lr 6e-4, 4% warmup then cosine, clip 1.0,
#                AdamW f32 masters, bf16 compute, for STEPS optimizer steps (the schedule spans
#                them; pick STEPS so the run takes 6 minutes: STEPS=60 first and read step_s),
#                TRAIN_FLAGS for the path (e.g. the old one: `--train-attention composed
#                --train-ops composed --optimizer reference`). Peak memory from nvidia-smi.
#   PHASE=eval   `dflash-train eval`, offline, of the CHECKPOINTS (NAME=DIR ...) on
#                deploy/bench/data/tiny-recipe-eval-prompts.jsonl (the 10 prompts of
#                prompts-coding.jsonl and the prompts of the first 54 records of eval.jsonl.xz),
#                256 tokens, budgets 4,8,16,32,64.
#
# Paths: BIN (dflash-train), DATA_IN (the 3,000 input records, JSONL), DATA (the regenerated
# output), RUN (the run's output dir), OUT (where results go); DEV (cuda, or cpu for a smoke
# test of the flags). Run from the repository root.
set -u
: "${PHASE:?regen, train or eval}" "${BIN:?path to dflash-train}" "${OUT:?results dir}"
DEV=${DEV:-cuda}; DEV_N=$DEV; [ "$DEV" = cuda ] && DEV_N=cuda:0
T0=$(date +%s); el() { echo $(( $(date +%s) - T0 )); }
case "$PHASE" in
regen)
  : "${DATA_IN:?input records}" "${DATA:?output file}"
  timeout "${TLIM:-540}" "$BIN" regenerate --target-model serve/assets/tiny-coder-demo --input "$DATA_IN" \
    --output "$DATA" --max-new-tokens 384 --batch-size 32 --drafter serve/assets/tiny-coder-demo-dflash \
    --ddtree-budget 0 --device "$DEV" > "$OUT/regen.log" 2>&1
  echo "regen rc=$? at $(el) s lines=$(wc -l < "$DATA")"; tail -n 2 "$OUT/regen.log" | cut -c1-240
  ;;
train)
  : "${DATA:?regenerated records}" "${RUN:?run dir}" "${STEPS:?optimizer steps}"
  name=${NAME:-run}
  nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -lms 300 > "$OUT/mem_$name.txt" &
  smi=$!
  # shellcheck disable=SC2086
  timeout "${TLIM:-540}" "$BIN" train --target-model serve/assets/tiny-coder-demo --dataset "$DATA" \
    --max-records 3000 --num-draft-layers 2 --target-layer-ids 0,1,2 --block-size 16 --num-anchors 256 \
    --batch-size 32 --min-ready 64 --max-depth 128 --lr 6e-4 --warmup-ratio 0.04 --max-steps "$STEPS" \
    --log-every 50 --save-every 100000000 --target-devices "$DEV_N" --drafter-device "$DEV_N" \
    --output-dir "$RUN" ${TRAIN_FLAGS:-} > "$OUT/train_$name.log" 2>&1
  rc=$?; kill $smi
  echo "train $name rc=$rc at $(el) s peak_mem_mib=$(sort -n "$OUT/mem_$name.txt" | tail -1)"
  cp "$RUN/metrics.jsonl" "$OUT/metrics_$name.jsonl" 2>/dev/null
  grep '"kind":"window"' "$RUN/metrics.jsonl" | tail -n 2 | cut -c1-300
  ls "$RUN"
  ;;
eval)
  : "${CHECKPOINTS:?NAME=DIR ...}"
  args=()
  for c in $CHECKPOINTS; do args+=(--drafter "$c"); done
  timeout "${TLIM:-540}" "$BIN" eval --target serve/assets/tiny-coder-demo "${args[@]}" \
    --prompts deploy/bench/data/tiny-recipe-eval-prompts.jsonl --max-new-tokens 256 --budgets 4,8,16,32,64 \
    --device "$DEV" --cache-dir /tmp/eval-cache --out-dir "$OUT/eval" > "$OUT/eval.log" 2>&1
  echo "eval rc=$? at $(el) s"; tail -n 20 "$OUT/eval.log" | cut -c1-240
  ;;
*) echo "PHASE must be regen, train or eval" >&2; exit 2 ;;
esac
