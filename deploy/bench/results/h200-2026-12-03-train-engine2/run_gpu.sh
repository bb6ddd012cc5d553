#!/usr/bin/env bash
# One device run (issue 18, train engine 2): gpu_check --train (incl. the packed target forward
# against the full forward), then the tiny-coder-demo reference trainer config
# (--train-attention fused, then fused-scalar unless NO_SCALAR). Key figures go to stdout.
mkdir -p /tmp/b && tar -xJf .gpu-18/bundle.tar.xz -C /tmp/b && . /tmp/b/env.sh
cp .gpu-18/train3000.jsonl.xz /tmp/b/
ROOT=$PWD; export DFLASH_TESTS_DIR=$PWD/tests
cd /tmp/b
nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total --format=csv,noheader
COMMON="train --target-model $ROOT/serve/assets/tiny-coder-demo --dataset /tmp/b/train3000.jsonl.xz --max-records 3000 --num-draft-layers 2 --target-layer-ids 0,1,2 --block-size 16 --num-anchors 256 --batch-size 32 --min-ready 64 --max-depth 128 --lr 6e-4 --max-steps 1000 --stop-after-steps ${STEPS:-30} --log-every 10 --save-every 100000 --target-devices cuda:0 --drafter-device cuda:0"
run() {  # name extra-args
  local name=$1; shift
  echo "== trainer $name $*"
  nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -lms 300 > $OUT/mem_$name.txt &
  local smi=$!
  local t0=$(( $(date +%s%N) / 1000000 ))
  timeout ${TLIM:-80} ./dflash-train $COMMON --output-dir /tmp/run_$name "$@" > $OUT/log_$name.txt 2>&1
  local rc=$?; echo "rc=$rc wall_ms=$(( $(date +%s%N) / 1000000 - t0 ))"
  kill $smi
  echo "peak_mem_mib=$(sort -n $OUT/mem_$name.txt | tail -1) (idle $(head -1 $OUT/mem_$name.txt))"
  grep '"kind":"window"' /tmp/run_$name/metrics.jsonl | cut -c1-600
  grep -E "error|Error|panick" $OUT/log_$name.txt | tail -3 | cut -c1-400
  cp /tmp/run_$name/metrics.jsonl $OUT/metrics_$name.jsonl 2>/dev/null
}
[ -n "$NO_SCALAR" ] || run fused_scalar --train-attention fused-scalar
if [ -z "$NO_CHECK" ]; then
  echo "== gpu_check --train"
  timeout ${CLIM:-120} ./gpu_check cuda $OUT/train_check.json --train 2>&1 | grep -v '^{"train"' | cut -c1-900 | tail -30
  echo "rc=${PIPESTATUS[0]}"
fi
run fused --train-attention fused
