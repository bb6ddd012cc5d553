#!/usr/bin/env bash
# Issue 18: one 6-minute run of the tiny recipe on the regenerated data (committed, complete since
# session 21) under ENGINE (default explicit; STEPS from the engine's calibrated step time:
# STEPS = 360 / step_s), then `dflash-train eval` of its checkpoint on the held-out prompts.
# TRAIN_FLAGS_EXTRA adds flags (e.g. the old path: `--train-attention composed --train-ops
# composed --optimizer reference --train-engine autograd`).
set -u
D=${D:-.gpu-train}; ENGINE=${ENGINE:-explicit}; STEPS=${STEPS:?optimizer steps for 6 minutes}
mkdir -p /tmp/b && tar -xJf $D/bundle.tar.xz -C /tmp/b && . /tmp/b/env.sh
T0=$(date +%s); el() { echo $(( $(date +%s) - T0 )); }
mkdir -p $OUT/r .gpu-data
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee $OUT/r/gpu.txt
xz -dc deploy/bench/data/tiny-recipe-train3000-regen.jsonl.xz > .gpu-data/train3000-regen.jsonl
[ "$(wc -l < .gpu-data/train3000-regen.jsonl)" = 3000 ] || { echo "regenerated data incomplete"; exit 1; }
NAME=six-$ENGINE
PHASE=train BIN=/tmp/b/dflash-train OUT=$OUT/r DATA=.gpu-data/train3000-regen.jsonl RUN=/tmp/run-six \
  STEPS=$STEPS NAME=$NAME TRAIN_FLAGS="--train-engine $ENGINE ${TRAIN_FLAGS_EXTRA:-}" TLIM=${TLIM:-420} \
  bash deploy/bench/tiny_recipe.sh
# The run dir's top level holds the exported drafter (config.json, model.safetensors).
left=$(( ${END:-585} - $(el) ))
if [ -f /tmp/run-six/model.safetensors ] && [ $left -gt 20 ]; then
  mkdir -p $OUT/r/$NAME-drafter && cp /tmp/run-six/config.json /tmp/run-six/model.safetensors $OUT/r/$NAME-drafter/
  PHASE=eval BIN=/tmp/b/dflash-train OUT=$OUT/r CHECKPOINTS="$NAME=/tmp/run-six" TLIM=$left bash deploy/bench/tiny_recipe.sh
fi
tar -C $OUT -cJf $OUT/tiny.tar.xz r && rm -rf $OUT/r
echo "done at $(el) s"
