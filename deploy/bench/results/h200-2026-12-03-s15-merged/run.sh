#!/usr/bin/env bash
# Session 15's closing device call on merged main: the reference trainer config with the fused
# AdamW (default) and with --optimizer reference, gpu_check --train (with the trainer_optimizer
# resume / NaN-skip / parity cases), gpu_check --hybrid (graph vs eager). Bundle: .gpu-final/.
D=.gpu-final
mkdir -p /tmp/b && tar -xJf $D/bundle.tar.xz -C /tmp/b && . /tmp/b/env.sh
cp $D/train3000.jsonl.xz /tmp/b/
ROOT=$PWD; export DFLASH_TESTS_DIR=$PWD/tests
T0=$(date +%s); el() { echo $(( $(date +%s) - T0 )); }
cd /tmp/b
COMMON="train --target-model $ROOT/serve/assets/tiny-coder-demo --dataset /tmp/b/train3000.jsonl.xz --max-records 3000 --num-draft-layers 2 --target-layer-ids 0,1,2 --block-size 16 --num-anchors 256 --batch-size 32 --min-ready 64 --max-depth 128 --lr 6e-4 --max-steps 1000 --stop-after-steps 30 --log-every 10 --save-every 100000 --target-devices cuda:0 --drafter-device cuda:0 --train-attention fused"
run() {
  local name=$1; shift
  echo "== trainer $name $*"
  nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -lms 300 > $OUT/mem_$name.txt &
  local smi=$!
  timeout ${TLIM:-45} ./dflash-train $COMMON --output-dir /tmp/run_$name "$@" > $OUT/log_$name.txt 2>&1
  echo "rc=$? at $(el) s"; kill $smi
  echo "peak_mem_mib=$(sort -n $OUT/mem_$name.txt | tail -1)"
  grep '"kind":"window"' /tmp/run_$name/metrics.jsonl | python3 -c '
import json, sys
for l in sys.stdin:
    w = json.loads(l)
    print("window step %d: loss %.6f tok/s %.0f step_s %.4f fwd %.4f bwd %.4f opt %.4f" % (w["step"], w["loss"], w["tokens_per_s"], w["step_s"], w["stage_drafter_forward_s"], w["stage_drafter_backward_s"], w["stage_optimizer_s"]))'
  grep -E "error|Error|panick" $OUT/log_$name.txt | tail -3 | cut -c1-400
}
run fused_adamw
run reference_adamw --optimizer reference
echo "== gpu_check --train at $(el) s"
timeout 120 ./gpu_check cuda $OUT/train_check.json --train > $OUT/train_check.log 2>&1; echo "rc=$?"
grep -E '"pass":false' $OUT/train_check.log | cut -c1-300 | head -5
grep -E '^trainer_optimizer' $OUT/train_check.log | cut -c1-700
grep -c '"pass":true' $OUT/train_check.log
echo "== gpu_check --hybrid at $(el) s"
timeout 80 ./gpu_check cuda $OUT/hybrid.json --hybrid > $OUT/hybrid.log 2>&1; echo "rc=$?"
grep -E 'graph vs eager|decode|verify' $OUT/hybrid.log | cut -c1-600 | head -12
echo "done at $(el) s"
