#!/usr/bin/env bash
# Issue 18: the explicit training engine on the GPU (checks, then the 8B recipe under each
# engine), a 60-step tiny-recipe calibration of each engine on the committed partial data (its
# step_s sets STEPS for the 6-minute runs), and the tiny recipe's data regenerated to the end
# with what time is left.
set -u
D=${D:-.gpu-train}
mkdir -p /tmp/b && tar -xJf $D/bundle.tar.xz -C /tmp/b && . /tmp/b/env.sh
T0=$(date +%s); el() { echo $(( $(date +%s) - T0 )); }
mkdir -p $OUT/t $OUT/r .gpu-data
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee $OUT/t/gpu.txt
export DFLASH_TESTS_DIR=$PWD/tests
TRAIN=/tmp/b/dflash-train CHECK=/tmp/b/gpu_check OUT=$OUT/t TLIM=150 STEPS=12 \
  bash deploy/bench/train_engines.sh
echo "train engines done at $(el) s"
xz -dc deploy/bench/data/tiny-recipe-train3000-regen.jsonl.xz > .gpu-data/train3000-regen.jsonl
cp deploy/bench/data/tiny-recipe-train3000-regen.jsonl.progress.json .gpu-data/train3000-regen.jsonl.progress.json
for e in explicit autograd; do
  left=$(( 420 - $(el) )); [ $left -gt 40 ] || break
  PHASE=train BIN=/tmp/b/dflash-train OUT=$OUT/r DATA=.gpu-data/train3000-regen.jsonl RUN=/tmp/run-$e \
    STEPS=60 NAME=cal-$e TRAIN_FLAGS="--train-engine $e" TLIM=$(( left < 90 ? left : 90 )) \
    bash deploy/bench/tiny_recipe.sh
  rm -rf /tmp/run-$e
done
# The input travels in the bundle dir (../shared is not on the device): made with
# `xz -dc ../shared/fixtures/corpus/train.jsonl.xz | head -3000 | xz > $D/train3000-in.jsonl.xz`.
left=$(( 575 - $(el) ))
if [ $left -gt 30 ] && xz -dc $D/train3000-in.jsonl.xz > .gpu-data/train3000-in.jsonl \
   && [ "$(wc -c < .gpu-data/train3000-in.jsonl)" = 8139412 ]; then
  PHASE=regen BIN=/tmp/b/dflash-train OUT=$OUT/r DATA_IN=.gpu-data/train3000-in.jsonl \
    DATA=.gpu-data/train3000-regen.jsonl TLIM=$left bash deploy/bench/tiny_recipe.sh
  xz -6 -c .gpu-data/train3000-regen.jsonl > $OUT/r/train3000-regen.jsonl.xz
  cp .gpu-data/train3000-regen.jsonl.progress.json $OUT/r/
fi
tar -C $OUT -cJf $OUT/train-engines.tar.xz t r && rm -rf $OUT/t $OUT/r
echo "done at $(el) s"
