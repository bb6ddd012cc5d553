#!/usr/bin/env bash
# Issue 18: the tiny recipe's old path for 6 minutes (today's reference pieces: autograd over
# the composed attention, composed norm/RoPE/SiLU, composed head loss, the reference AdamW),
# its step count from a 10-step calibration in the same call, then `dflash-train eval` of its
# drafter beside session 21's 6-minute explicit-engine drafter (committed in
# deploy/bench/results/h100-2026-12-06-s21/call4/six-explicit-drafter.tar.xz) on the same
# held-out prompts. Bundle: dflash-train.
set -u
D=${D:-.gpu-train}
mkdir -p /tmp/b && tar -xJf $D/bundle.tar.xz -C /tmp/b && . /tmp/b/env.sh
T0=$(date +%s); el() { echo $(( $(date +%s) - T0 )); }
mkdir -p $OUT/o .gpu-data /tmp/s21
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee $OUT/o/gpu.txt
xz -dc deploy/bench/data/tiny-recipe-train3000-regen.jsonl.xz > .gpu-data/train3000-regen.jsonl
tar -xJf deploy/bench/results/h100-2026-12-06-s21/call4/six-explicit-drafter.tar.xz -C /tmp/s21
OLD="--train-engine autograd --train-attention composed --train-ops composed --head-loss composed --optimizer reference"
PHASE=train BIN=/tmp/b/dflash-train OUT=$OUT/o DATA=.gpu-data/train3000-regen.jsonl RUN=/tmp/run-cal \
  STEPS=1000 NAME=old-cal TRAIN_FLAGS="$OLD --stop-after-steps 10" TLIM=120 bash deploy/bench/tiny_recipe.sh
# The median step time of steps 4-10 (the per-step records; the first steps include warm-up).
step=$(grep '"kind":"step"' $OUT/o/metrics_old-cal.jsonl | tail -n 7 | python3 -c "import sys,json,statistics; print(statistics.median(json.loads(l)['step_s'] for l in sys.stdin))")
steps=$(python3 -c "print(max(10, int(360 / $step)))"); echo "old path step ${step} s -> ${steps} steps"
rm -rf /tmp/run-cal
# The run must end (and save) inside the call: it gets what is left minus the eval's time.
PHASE=train BIN=/tmp/b/dflash-train OUT=$OUT/o DATA=.gpu-data/train3000-regen.jsonl RUN=/tmp/run-old \
  STEPS=$steps NAME=six-old TRAIN_FLAGS="$OLD" TLIM=$(( 500 - $(el) )) bash deploy/bench/tiny_recipe.sh
left=$(( 585 - $(el) ))
if [ -f /tmp/run-old/model.safetensors ] && [ $left -gt 20 ]; then
  PHASE=eval BIN=/tmp/b/dflash-train OUT=$OUT/o TLIM=$left \
    CHECKPOINTS="six-explicit=/tmp/s21/six-explicit-drafter six-old=/tmp/run-old" bash deploy/bench/tiny_recipe.sh
fi
tar -C $OUT -cJf $OUT/old.tar.xz o && rm -rf $OUT/o
echo "done at $(el) s"
