#!/usr/bin/env bash
# H200 training throughput of a Qwen3-8B-shaped target (random bf16 weights) with a 5-layer,
# 4096-hidden DFlash drafter (block 16, 512 anchors per 2048-token sequence), target and drafter
# on the one GPU. Writes logs, metrics.jsonl and TensorBoard files of each configuration to $OUT.
# See train/GPU_RUNS.md for how to build, bundle and launch it. BUNDLE overrides the bundle path;
# TARGETS (e.g. cuda:0,cuda:1) and DRAFTER (e.g. cuda:2) choose the topology; SHAPE and LEN the
# target shape and sequence length (a CPU dry run: SHAPE=tiny LEN=64 TARGETS=cpu DRAFTER=cpu SECS=8).
# Random weights can give non-finite losses; those steps are skipped (and counted), never fatal here.
set -u
mkdir -p /tmp/b && tar -xJf "${BUNDLE:-.gpu/bundle.tar.xz}" -C /tmp/b && . /tmp/b/env.sh
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=utilization.gpu,power.draw,memory.used,temperature.gpu --format=csv -l 5 > "$OUT/nvidia-smi.csv" 2>&1 &
SMI=$!
# run NAME SECONDS [extra flags]: one configuration, killed after SECONDS (no checkpoint is
# written: --save-every is out of reach; the metrics are flushed line by line).
run() {
  local name=$1 secs=$2; shift 2
  timeout "$secs" dflash-train train --target-model "random:${SHAPE:-qwen3-8b}" \
    --dataset "synthetic:len=${LEN:-2048},n=5000" --max-len "${LEN:-2048}" \
    --num-draft-layers 5 --block-size 16 \
    --target-devices "${TARGETS:-cuda:0}" --drafter-device "${DRAFTER:-cuda:0}" \
    --max-steps 100000 --save-every 100000000 --log-every 5 --max-nonfinite-steps 1000000 \
    --output-dir "/tmp/$name" "$@" > "$OUT/$name.log" 2>&1
  echo "== $name: exit $? (124 = stopped by the time limit, as intended)"
  cp "/tmp/$name/metrics.jsonl" "$OUT/$name.metrics.jsonl" 2>/dev/null
  cp -r "/tmp/$name/tensorboard" "$OUT/$name.tensorboard" 2>/dev/null
  grep -E "step [0-9]+/" "$OUT/$name.log" | tail -3
  grep -iE "error|panic|out of memory" "$OUT/$name.log" | head -5
  rm -rf "/tmp/$name"
}
# The recipe's 512 anchors first; the drafter's training attention is materialised in f32 per
# group of 64 blocks, so 512 anchors x 2048 tokens may not fit beside the target (then it fails
# within its first step and the next configuration runs).
S=${SECS:-160}
run a512b1 $S --batch-size 1 --grad-accum 4 --num-anchors 512 "$@"
run a256b1 $S --batch-size 1 --grad-accum 4 --num-anchors 256 "$@"
run a256b2 $S --batch-size 2 --grad-accum 2 --num-anchors 256 "$@"
kill $SMI 2>/dev/null
