#!/usr/bin/env bash
# Issue 18: the tiny recipe's data to the end (resuming the committed CPU-made part), then a
# 60-step calibration run of each engine (their step_s sets STEPS for the 6-minute runs:
# STEPS = 360 / step_s).
set -u
D=${D:-.gpu-train}
mkdir -p /tmp/b && tar -xJf $D/bundle.tar.xz -C /tmp/b && . /tmp/b/env.sh
T0=$(date +%s); el() { echo $(( $(date +%s) - T0 )); }
mkdir -p $OUT/r .gpu-data
# The input travels in the bundle dir (../shared is not on the device): make it with
# `xz -dc ../shared/fixtures/corpus/train.jsonl.xz | head -3000 | xz > $D/train3000-in.jsonl.xz`.
xz -dc $D/train3000-in.jsonl.xz > .gpu-data/train3000-in.jsonl || exit 1
[ "$(wc -c < .gpu-data/train3000-in.jsonl)" = 8139412 ] || { echo "unexpected input size"; exit 1; }
[ -f .gpu-data/train3000-regen.jsonl ] || {
  xz -dc deploy/bench/data/tiny-recipe-train3000-regen.jsonl.xz > .gpu-data/train3000-regen.jsonl
  cp deploy/bench/data/tiny-recipe-train3000-regen.jsonl.progress.json .gpu-data/train3000-regen.jsonl.progress.json
}
PHASE=regen BIN=/tmp/b/dflash-train OUT=$OUT/r DATA_IN=.gpu-data/train3000-in.jsonl \
  DATA=.gpu-data/train3000-regen.jsonl TLIM=300 bash deploy/bench/tiny_recipe.sh
xz -6 -c .gpu-data/train3000-regen.jsonl > $OUT/r/train3000-regen.jsonl.xz
cp .gpu-data/train3000-regen.jsonl.progress.json $OUT/r/
for e in explicit autograd; do
  left=$(( 570 - $(el) )); [ $left -gt 60 ] || break
  PHASE=train BIN=/tmp/b/dflash-train OUT=$OUT/r DATA=.gpu-data/train3000-regen.jsonl RUN=/tmp/run-$e \
    STEPS=60 NAME=cal-$e TRAIN_FLAGS="--train-engine $e" TLIM=$(( left / 2 )) bash deploy/bench/tiny_recipe.sh
  rm -rf /tmp/run-$e
done
tar -C $OUT -cJf $OUT/tiny.tar.xz r && rm -rf $OUT/r
echo "done at $(el) s"
