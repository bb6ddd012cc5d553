#!/usr/bin/env bash
# Issue 18, the recipe at the 8B scale: Qwen3-8B-shaped random target + 5-layer 4096-hidden drafter,
# block 16, 512 anchors, one GPU for both. Memory table 2048/3072/4096 tokens x batch 1/2/4, then a
# per-kernel profile (ncu, GPU time per kernel) of a few steps of the 2048 x 4 configuration.
D=.gpu-train
mkdir -p /tmp/b && tar -xJf $D/bundle.tar.xz -C /tmp/b && . /tmp/b/env.sh
T0=$(date +%s); el() { echo $(( $(date +%s) - T0 )); }
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader | tee $OUT/gpu.txt
COMMON="--target-model random:qwen3-8b --num-draft-layers 5 --block-size 16 --num-anchors 512 --target-devices cuda:0 --drafter-device cuda:0 --max-steps 100000 --save-every 100000000 --max-nonfinite-steps 1000000 --grad-accum 1"
summ() {
python3 - "$1" "$2" <<'PY'
import json, sys
name, f = sys.argv[1], sys.argv[2]
ws = [json.loads(l) for l in open(f) if '"kind":"window"' in l]
if not ws: print(name, "no window"); sys.exit()
w = ws[-1]
g = lambda k: w.get(k, float('nan'))
print("%s step %d tok/s %.0f step_s %.3f target_fwd_s %.3f busy %.2f wait %.3f h2d %.4f dfwd %.3f dbwd %.3f opt %.4f mfu %.3f mfu_d %.3f mfu_t %.3f dTF %.0f tTF %.0f loss %.3f" % (
  name, w["step"], g("tokens_per_s"), g("step_s"), g("target_forward_s"), g("target_busy_frac"), g("queue_wait_s"),
  g("stage_h2d_s"), g("stage_drafter_forward_s"), g("stage_drafter_backward_s"), g("stage_optimizer_s"),
  g("mfu"), g("mfu_drafter"), g("mfu_target"), g("drafter_tflops"), g("target_tflops"), g("loss")))
PY
}
run() {
  local name=$1 len=$2 bs=$3 steps=$4; shift 4
  nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -lms 200 > /tmp/mem_$name.txt &
  local smi=$!
  timeout ${TLIM:-60} dflash-train train $COMMON --dataset synthetic:len=$len,n=5000 --max-len $len \
    --batch-size $bs --stop-after-steps $steps --log-every $(( steps / 2 )) --output-dir /tmp/run_$name "$@" > /tmp/log_$name.txt 2>&1
  local rc=$?; kill $smi
  echo "== $name len=$len bs=$bs rc=$rc at $(el) s peak_mem_mib=$(sort -n /tmp/mem_$name.txt | tail -1)"
  summ $name /tmp/run_$name/metrics.jsonl
  grep -iE "error|panic|out of memory" /tmp/log_$name.txt | head -3 | cut -c1-300
  cat /tmp/run_$name/metrics.jsonl >> $OUT/metrics_all.jsonl 2>/dev/null
  tail -5 /tmp/log_$name.txt >> $OUT/logs_tail.txt
  rm -rf /tmp/run_$name
}
# the headline configuration first, longer, then the memory table
TLIM=100 run l2048b4 2048 4 16
for len in 2048 3072 4096; do for bs in 1 2 4; do
  [ "$len$bs" = "20484" ] && continue
  run l${len}b$bs $len $bs 4
done; done
echo "== ncu profile at $(el) s"
if command -v ncu >/dev/null; then
  timeout 200 ncu --clock-control none --metrics gpu__time_duration.sum --csv --launch-skip 0 \
    dflash-train train $COMMON --dataset synthetic:len=2048,n=5000 --max-len 2048 --batch-size 4 \
    --stop-after-steps 3 --log-every 1 --output-dir /tmp/run_ncu > /tmp/ncu.csv 2>/tmp/ncu.err
  echo "ncu rc=$? at $(el) s"; tail -3 /tmp/ncu.err
  python3 $D/ncu_sum.py /tmp/ncu.csv > $OUT/ncu_summary.txt 2>&1; head -40 $OUT/ncu_summary.txt
  xz -9 -c /tmp/ncu.csv > $OUT/ncu.csv.xz
fi
echo "done at $(el) s"
