#!/usr/bin/env bash
# Session 18, device call C (issues 18, 23): the one-GPU NCCL / data-parallel checks, the 8B recipe
# with background checkpoints (loop stall), a per-kernel profile of one 8B step, and the tiny
# recipe's regenerated data finished on the GPU (for the 6-minute comparison).
set -u
D=.gpu-s18c
mkdir -p /tmp/b && tar -xJf $D/bundle.tar.xz -C /tmp/b && . /tmp/b/env.sh
mkdir -p .gpu-data && xz -dc $D/train3000-in.jsonl.xz > .gpu-data/train3000-in.jsonl && cp $D/train3000-regen.jsonl* .gpu-data/
T0=$(date +%s); el() { echo $(( $(date +%s) - T0 )); }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee $OUT/gpu.txt
export LD_LIBRARY_PATH=$(python3 -c "import nvidia.nccl, os; print(os.path.join(list(nvidia.nccl.__path__)[0], 'lib'))"):$LD_LIBRARY_PATH
( cd /tmp/b && timeout 120 ./gpu_check_nccl cuda $OUT/dp.json --data-parallel > $OUT/dp.log 2>&1; echo "gpu_check --data-parallel rc=$? at $(el) s" )
tail -n 12 $OUT/dp.log | cut -c1-240
# the 8B recipe with a checkpoint every 6 steps (background writer)
COMMON="--target-model random:qwen3-8b --num-draft-layers 5 --block-size 16 --num-anchors 512 --target-devices cuda:0 --drafter-device cuda:0 --max-steps 100000 --grad-accum 1 --dataset synthetic:len=2048,n=5000 --max-len 2048 --batch-size 4"
nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -lms 200 > /tmp/mem_ck.txt & SMI=$!
rm -rf /tmp/q8 /tmp/q8-dflash; timeout 150 /tmp/b/dflash-train train $COMMON --save-every 6 --keep-checkpoints 1 --save-dtype bf16 --stop-after-steps 18 --log-every 6 --output-dir /tmp/run_ck > $OUT/ck.log 2>&1
echo "8b ckpt run rc=$? at $(el) s peak_mem_mib=$(sort -n /tmp/mem_ck.txt | tail -1)"; kill $SMI
grep -E '"kind":"(window|checkpoint)"' /tmp/run_ck/metrics.jsonl > $OUT/ck_metrics.jsonl; cut -c1-400 $OUT/ck_metrics.jsonl
ls -la /tmp/run_ck | head; rm -rf /tmp/run_ck
# the tiny recipe's data: regenerate the rest of the first 3,000 prompts on the GPU (resumable)
timeout 100 /tmp/b/dflash-train regenerate --target-model serve/assets/tiny-coder-demo --input .gpu-data/train3000-in.jsonl \
  --output .gpu-data/train3000-regen.jsonl --max-new-tokens 384 --batch-size 64 --drafter serve/assets/tiny-coder-demo-dflash \
  --ddtree-budget 0 --device cuda > $OUT/regen.log 2>&1
echo "regen rc=$? at $(el) s lines=$(wc -l < .gpu-data/train3000-regen.jsonl)"; tail -n 3 $OUT/regen.log | cut -c1-240
xz -9 -c .gpu-data/train3000-regen.jsonl > $OUT/train3000-regen.jsonl.xz; cp .gpu-data/train3000-regen.jsonl.progress.json $OUT/ 2>/dev/null
# one 8B step (2048 x 1, serialized), every kernel timed by ncu
left=$(( 570 - $(el) )); [ $left -gt 60 ] || exit 0
timeout $left ncu --clock-control none --metrics gpu__time_duration.sum --csv --launch-count 6000 \
  /tmp/b/dflash-train train --target-model random:qwen3-8b --num-draft-layers 5 --block-size 16 --num-anchors 512 --target-devices cuda:0 --drafter-device cuda:0 --max-steps 100000 --save-every 100000000 --dataset synthetic:len=2048,n=8 --max-len 2048 --batch-size 1 --stop-after-steps 1 --log-every 1 --serialize-target --output-dir /tmp/run_ncu > /tmp/ncu.csv 2>/tmp/ncu.err
echo "ncu rc=$? at $(el) s"; tail -2 /tmp/ncu.err | cut -c1-200
python3 deploy/bench/results/h200-2026-12-06-train8b/ncu_sum.py /tmp/ncu.csv > $OUT/ncu_summary.txt 2>&1; head -50 $OUT/ncu_summary.txt
xz -9 -c /tmp/ncu.csv > $OUT/ncu.csv.xz
