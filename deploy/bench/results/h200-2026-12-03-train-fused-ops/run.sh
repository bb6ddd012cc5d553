#!/usr/bin/env bash
# One device run (issue 18, fused norm / RoPE / SiLU ops): the tiny-coder-demo reference trainer
# config with --train-ops fused (the new ops) and --train-ops composed (candle's compositions;
# attention fused in both), steps 21-30 timed as in ../h200-2026-12-03-train-engine2/run_gpu.sh,
# then `gpu_check cuda OUT --train`. Key figures go to stdout. Bundle and dataset: .gpu-train/.
D=.gpu-train
mkdir -p /tmp/b && tar -xJf $D/bundle.tar.xz -C /tmp/b && . /tmp/b/env.sh
cp $D/train3000.jsonl.xz /tmp/b/
ROOT=$PWD; export DFLASH_TESTS_DIR=$PWD/tests
cd /tmp/b
nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total --format=csv,noheader
COMMON="train --target-model $ROOT/serve/assets/tiny-coder-demo --dataset /tmp/b/train3000.jsonl.xz --max-records 3000 --num-draft-layers 2 --target-layer-ids 0,1,2 --block-size 16 --num-anchors 256 --batch-size 32 --min-ready 64 --max-depth 128 --lr 6e-4 --max-steps 1000 --stop-after-steps ${STEPS:-30} --log-every 10 --save-every 100000 --target-devices cuda:0 --drafter-device cuda:0 --train-attention fused"
run() {  # name extra-args
  local name=$1; shift
  echo "== trainer $name $*"
  nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -lms 300 > $OUT/mem_$name.txt &
  local smi=$!
  local t0=$(( $(date +%s%N) / 1000000 ))
  timeout ${TLIM:-50} ./dflash-train $COMMON --output-dir /tmp/run_$name "$@" > $OUT/log_$name.txt 2>&1
  local rc=$?; echo "rc=$rc wall_ms=$(( $(date +%s%N) / 1000000 - t0 ))"
  kill $smi
  echo "peak_mem_mib=$(sort -n $OUT/mem_$name.txt | tail -1) (idle $(head -1 $OUT/mem_$name.txt))"
  grep '"kind":"window"' /tmp/run_$name/metrics.jsonl | python3 -c '
import json, sys
for l in sys.stdin:
    w = json.loads(l)
    print("window step %d: loss %.6f tok/s %.0f step_s %.4f fwd %.4f bwd %.4f opt %.4f h2d %.4f target %.4f mem_gib %.2f" % (
        w["step"], w["loss"], w["tokens_per_s"], w["step_s"], w["stage_drafter_forward_s"],
        w["stage_drafter_backward_s"], w["stage_optimizer_s"], w["stage_h2d_s"],
        w["target_forward_s"], w.get("gpu0_mem_used_gib", -1)))'
  grep -E "error|Error|panick" $OUT/log_$name.txt | tail -3 | cut -c1-400
  cp /tmp/run_$name/metrics.jsonl $OUT/metrics_$name.jsonl 2>/dev/null
}
run fused --train-ops fused
[ -n "$NO_COMPOSED" ] || run composed_ops --train-ops composed
echo "== gpu_check --train"
timeout ${CLIM:-110} ./gpu_check cuda $OUT/train_check.json --train 2>&1 | grep -v '^{"train"' | cut -c1-1200 | tail -40
echo "rc=${PIPESTATUS[0]}"
