#!/usr/bin/env bash
# Issue 18: session 21's unmeasured trainer changes on the GPU, in one call (bundle: dflash-train
# + gpu_check, built at or after 512ef32).
#   1. `gpu_check cuda --train`: the vectorised cross-entropy rows (linear_ce_*), AdamW and the
#      gradient packing (gradient_pack: bit for bit), the attention checks and the pipelined
#      context dk/dv kernel against the default (attn_dflash_dkv_pipelined_*: bit for bit, and
#      both backwards timed).
#   2. The 8B recipe (2048 x 4, 512 anchors), 12 steps, default kernels then
#      DFLASH_DKV_PIPELINED=1: sequence tok/s against session 21's 9,754 (goal 10,000).
#   3. The tiny recipe, 60 steps each way: step time against session 21's 0.0286 s.
# If the pipelined kernel passes and is faster, make it the default (models/src/cuda/mod.rs).
set -u
D=${D:-.gpu-train}
mkdir -p /tmp/b && tar -xJf $D/bundle.tar.xz -C /tmp/b && . /tmp/b/env.sh
T0=$(date +%s); el() { echo $(( $(date +%s) - T0 )); }
mkdir -p $OUT/a .gpu-data
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee $OUT/a/gpu.txt
export DFLASH_TESTS_DIR=$PWD/tests
( cd /tmp/b && timeout 240 ./gpu_check cuda $OUT/a/train.json --train > $OUT/a/train.log 2>&1; echo "gpu_check --train rc=$? at $(el) s" )
grep -E "^(linear_ce|adamw|gradient_pack|attn_dflash_dkv|attn_dflash_grad|attn_dflash_speed_trainer)" $OUT/a/train.log | cut -c1-420
for pipe in 0 1; do
  DFLASH_DKV_PIPELINED=$pipe TRAIN=/tmp/b/dflash-train CHECK=/tmp/b/gpu_check OUT=$OUT/a/pipe$pipe TLIM=120 \
    ENGINES=explicit SWEEP=1 LENS=2048 BATCHES=4 SWEEP_STEPS=12 bash deploy/bench/train_engines.sh
done
echo "8B done at $(el) s"
xz -dc deploy/bench/data/tiny-recipe-train3000-regen.jsonl.xz > .gpu-data/train3000-regen.jsonl
for pipe in 0 1; do
  left=$(( 570 - $(el) )); [ $left -gt 40 ] || break
  DFLASH_DKV_PIPELINED=$pipe PHASE=train BIN=/tmp/b/dflash-train OUT=$OUT/a DATA=.gpu-data/train3000-regen.jsonl \
    RUN=/tmp/run-tiny STEPS=60 NAME=tiny-pipe$pipe TLIM=$(( left < 80 ? left : 80 )) bash deploy/bench/tiny_recipe.sh
  rm -rf /tmp/run-tiny
done
tar -C $OUT -cJf $OUT/validate.tar.xz a && rm -rf $OUT/a
echo "done at $(el) s"
