#!/usr/bin/env bash
# Session 19, device call C (issue 18): gpu_check --trainer-optimizer (the pinned snapshot timed),
# the 8B recipe with a checkpoint every 6 steps (the loop's stall per checkpoint), then the tiny
# recipe's data: the rest of the first 3,000 prompts regenerated on the GPU (resumable,
# --batch-size 32 as the CPU run that made the first 480).
set -u
D=.gpu-s19c
mkdir -p /tmp/b && tar -xJf $D/bundle.tar.xz -C /tmp/b && . /tmp/b/env.sh
mkdir -p .gpu-data && xz -dc $D/train3000-in.jsonl.xz > .gpu-data/train3000-in.jsonl && cp $D/train3000-regen.jsonl* .gpu-data/
T0=$(date +%s); el() { echo $(( $(date +%s) - T0 )); }
mkdir -p $OUT/z
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee $OUT/z/gpu.txt
export DFLASH_TESTS_DIR=$PWD/tests
( cd /tmp/b && timeout 150 ./gpu_check cuda $OUT/z/topt.json --trainer-optimizer > $OUT/z/topt.log 2>&1; echo "gpu_check --trainer-optimizer rc=$? at $(el) s" )
grep "^trainer_optimizer_" $OUT/z/topt.log | cut -c1-600
COMMON="--target-model random:qwen3-8b --num-draft-layers 5 --block-size 16 --num-anchors 512 --target-devices cuda:0 --drafter-device cuda:0 --max-steps 100000 --grad-accum 1 --dataset synthetic:len=2048,n=5000 --max-len 2048 --batch-size 4"
nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -lms 200 > /tmp/mem_ck.txt & SMI=$!
rm -rf /tmp/run_ck; timeout 170 /tmp/b/dflash-train train $COMMON --save-every 6 --keep-checkpoints 1 --save-dtype bf16 --stop-after-steps 18 --log-every 6 --output-dir /tmp/run_ck > $OUT/z/ck.log 2>&1
echo "8b ckpt run rc=$? at $(el) s peak_mem_mib=$(sort -n /tmp/mem_ck.txt | tail -1)"; kill $SMI
grep -E '"kind":"(window|checkpoint)"' /tmp/run_ck/metrics.jsonl > $OUT/z/ck_metrics.jsonl; cut -c1-330 $OUT/z/ck_metrics.jsonl
rm -rf /tmp/run_ck
left=$(( 580 - $(el) ))
timeout $left /tmp/b/dflash-train regenerate --target-model serve/assets/tiny-coder-demo --input .gpu-data/train3000-in.jsonl \
  --output .gpu-data/train3000-regen.jsonl --max-new-tokens 384 --batch-size 32 --drafter serve/assets/tiny-coder-demo-dflash \
  --ddtree-budget 0 --device cuda > $OUT/z/regen.log 2>&1
echo "regen rc=$? at $(el) s lines=$(wc -l < .gpu-data/train3000-regen.jsonl)"; tail -n 3 $OUT/z/regen.log | cut -c1-240
xz -6 -c .gpu-data/train3000-regen.jsonl > $OUT/z/train3000-regen.jsonl.xz; cp .gpu-data/train3000-regen.jsonl.progress.json $OUT/z/
tar -C $OUT -cf $OUT/s19c.tar z && rm -rf $OUT/z
echo "done at $(el) s"
