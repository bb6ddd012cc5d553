#!/usr/bin/env bash
# Issue 18: where the explicit engine's step time goes. (1) The tiny recipe (regenerated data),
# 12 steps, every kernel timed by ncu: GPU kernel time per step against the step's wall time
# (host-bound or GPU-bound); nsys's CUDA API and kernel summaries too where nsys exists.
# (2) One 8B step (2048 x 1, serialized target) under ncu, as session 18 profiled autograd.
set -u
D=${D:-.gpu-train}
mkdir -p /tmp/b && tar -xJf $D/bundle.tar.xz -C /tmp/b && . /tmp/b/env.sh
T0=$(date +%s); el() { echo $(( $(date +%s) - T0 )); }
mkdir -p $OUT/p .gpu-data
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee $OUT/p/gpu.txt
which ncu nsys | tee $OUT/p/tools.txt
xz -dc deploy/bench/data/tiny-recipe-train3000-regen.jsonl.xz > .gpu-data/train3000-regen.jsonl
SUM=deploy/bench/results/h200-2026-12-06-train8b/ncu_sum.py
TINY="--target-model serve/assets/tiny-coder-demo --dataset .gpu-data/train3000-regen.jsonl --max-records 3000 \
 --num-draft-layers 2 --target-layer-ids 0,1,2 --block-size 16 --num-anchors 256 --batch-size 32 --min-ready 64 \
 --max-depth 128 --lr 6e-4 --warmup-ratio 0.04 --max-steps 3000 --save-every 100000000 --target-devices cuda:0 \
 --drafter-device cuda:0 --train-engine explicit"
# The step's wall time without a profiler, the same 12 steps.
timeout 60 /tmp/b/dflash-train train $TINY --stop-after-steps 12 --log-every 6 --output-dir /tmp/tiny-plain > $OUT/p/tiny_plain.log 2>&1
echo "tiny plain rc=$? at $(el) s"; grep '"window"' /tmp/tiny-plain/metrics.jsonl | tail -1 | cut -c1-300
cp /tmp/tiny-plain/metrics.jsonl $OUT/p/tiny_plain_metrics.jsonl
# The 8B recipe (2048 x 4, 512 anchors), 12 steps, without a profiler.
TRAIN=/tmp/b/dflash-train CHECK=/tmp/b/gpu_check OUT=$OUT/p TLIM=120 STEPS=12 ENGINES=explicit SWEEP=1 \
  LENS=2048 BATCHES=4 SWEEP_STEPS=12 bash deploy/bench/train_engines.sh
if which nsys > /dev/null; then
  timeout 120 nsys profile -t cuda -o /tmp/tiny-nsys --force-overwrite true /tmp/b/dflash-train train $TINY \
    --stop-after-steps 12 --log-every 6 --output-dir /tmp/tiny-nsys-run > $OUT/p/tiny_nsys_run.log 2>&1
  echo "nsys rc=$? at $(el) s"
  timeout 90 nsys stats -r cuda_api_sum,cuda_gpu_kern_sum -f csv -o /tmp/tiny-stats /tmp/tiny-nsys.nsys-rep > /dev/null 2>&1
  cp /tmp/tiny-stats* $OUT/p/ 2>/dev/null; ls $OUT/p
fi
timeout 150 ncu --clock-control none --metrics gpu__time_duration.sum --csv --launch-count 40000 \
  /tmp/b/dflash-train train $TINY --stop-after-steps 12 --log-every 6 --output-dir /tmp/tiny-ncu > /tmp/tiny-ncu.csv 2>/tmp/tiny-ncu.err
echo "tiny ncu rc=$? at $(el) s"; tail -2 /tmp/tiny-ncu.err | cut -c1-200
python3 $SUM /tmp/tiny-ncu.csv > $OUT/p/tiny_ncu_summary.txt 2>&1; head -40 $OUT/p/tiny_ncu_summary.txt
xz -9 -c /tmp/tiny-ncu.csv > $OUT/p/tiny_ncu.csv.xz
left=$(( 570 - $(el) )); [ $left -gt 60 ] && {
timeout $left ncu --clock-control none --metrics gpu__time_duration.sum --csv --launch-count 8000 \
  /tmp/b/dflash-train train --target-model random:qwen3-8b --num-draft-layers 5 --block-size 16 --num-anchors 512 \
  --target-devices cuda:0 --drafter-device cuda:0 --max-steps 100000 --save-every 100000000 \
  --dataset synthetic:len=2048,n=8 --max-len 2048 --batch-size 1 --stop-after-steps 1 --log-every 1 \
  --serialize-target --train-engine explicit --output-dir /tmp/run_ncu > /tmp/ncu8b.csv 2>/tmp/ncu8b.err
echo "8b ncu rc=$? at $(el) s"; tail -2 /tmp/ncu8b.err | cut -c1-200
python3 $SUM /tmp/ncu8b.csv > $OUT/p/ncu8b_summary.txt 2>&1; head -45 $OUT/p/ncu8b_summary.txt
xz -9 -c /tmp/ncu8b.csv > $OUT/p/ncu8b.csv.xz; }
tar -C $OUT -cJf $OUT/profile.tar.xz p && rm -rf $OUT/p
echo "done at $(el) s"
