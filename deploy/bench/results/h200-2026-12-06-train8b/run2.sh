#!/usr/bin/env bash
# Issue 18: the 8B recipe (512 anchors, 2048 x 4) with target and drafter overlapped on one GPU
# (default) against --serialize-target (each side alone, one after the other), same call.
D=.gpu-train
mkdir -p /tmp/b && tar -xJf $D/bundle.tar.xz -C /tmp/b && . /tmp/b/env.sh
T0=$(date +%s); el() { echo $(( $(date +%s) - T0 )); }
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee $OUT/gpu2.txt
COMMON="--target-model random:qwen3-8b --num-draft-layers 5 --block-size 16 --num-anchors 512 --target-devices cuda:0 --drafter-device cuda:0 --max-steps 100000 --save-every 100000000 --max-nonfinite-steps 1000000 --dataset synthetic:len=2048,n=400 --max-len 2048 --batch-size 4 --grad-accum 1 --stop-after-steps 100 --log-every 6"
run() {
  local name=$1 secs=$2; shift 2
  nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -lms 200 > /tmp/mem_$name.txt &
  local smi=$!
  timeout $secs dflash-train train $COMMON --output-dir /tmp/run_$name "$@" > /tmp/log_$name.txt 2>&1
  kill $smi
  echo "== $name at $(el) s peak_mem_mib=$(sort -n /tmp/mem_$name.txt | tail -1)"
  grep '"kind":"window"' /tmp/run_$name/metrics.jsonl | tee $OUT/windows_$name.jsonl | python3 -c '
import json, sys
for l in sys.stdin:
    w = json.loads(l); g = lambda k: w.get(k, float("nan"))
    print("step %d tok/s %.0f step_s %.3f wait %.3f target %.3f dfwd %.3f dbwd %.3f opt %.4f mfu %.3f (d %.3f t %.3f)" % (w["step"], g("tokens_per_s"), g("step_s"), g("queue_wait_s"), g("target_forward_s"), g("stage_drafter_forward_s"), g("stage_drafter_backward_s"), g("stage_optimizer_s"), g("mfu"), g("mfu_drafter"), g("mfu_target")))'
  grep -iE "error|panic|out of memory" /tmp/log_$name.txt | head -3 | cut -c1-300
}
run overlapped ${SECS:-75}
run serialized ${SECS:-75} --serialize-target
echo "done at $(el) s"
