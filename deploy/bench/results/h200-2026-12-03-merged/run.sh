#!/usr/bin/env bash
# Session 14's closing device call on merged main: the hybrid checks and Qwen3.6-27B bench
# (fused path), the 32K interference run with default flags (the final piece sizing), and the
# DFLASH chain with SGLANG_SIMULATE_ACC_LEN=6.5 at c=1,32. Bundle and script carried in .gpu-final/.
set -u
mkdir -p /tmp/b && tar -xJf .gpu-final/bundle.tar.xz -C /tmp/b && . /tmp/b/env.sh
T0=$(date +%s); el() { echo $(( $(date +%s) - T0 )); }
( CUDA_VISIBLE_DEVICES= OMP_NUM_THREADS=10 timeout 120 python3 deploy/bench/random_checkpoint.py --shape qwen3-8b --out /tmp/q8 --drafter /tmp/q8-dflash > $OUT/checkpoint.log 2>&1; echo "checkpoint rc=$? at $(el) s" > /tmp/ck.rc ) &
CK=$!
DFLASH_TESTS_DIR=$PWD/tests timeout 110 /tmp/b/gpu_check cuda $OUT/gpu_check_hybrid.json --hybrid > $OUT/hybrid.log 2>&1
echo "gpu_check --hybrid rc=$? at $(el) s"
python3 - <<'PY'
import json, os
try: r = json.load(open(os.environ['OUT'] + '/gpu_check_hybrid.json'))
except Exception as e: print('no hybrid json', e); raise SystemExit
def walk(x, path=''):
    if isinstance(x, dict):
        for k, v in x.items(): walk(v, path + '/' + k)
    elif isinstance(x, (int, float)) and any(s in path for s in ('ms', 'roofline', 'ratio', 'rel', 'argmax', 'agree', 'bytes')):
        print('%-70s %s' % (path[-70:], x))
walk(r)
PY
wait $CK; cat /tmp/ck.rc
NAME=x; start() { /tmp/b/dflash-serve --model-path /tmp/q8 --port 30000 "$@" > $OUT/server-$NAME.log 2>&1 & PID=$!; }
stop() { kill -TERM $PID; sleep 1; kill -9 $PID 2>/dev/null; wait $PID 2>/dev/null; }
NAME=plain; start --speculative-algorithm NONE
timeout 80 python3 deploy/bench/load.py http://127.0.0.1:30000 --interference 32768 --interference-streams 16 \
  --output-len 2048 --ready-timeout 60 --timeout 60 --out $OUT/interference.json > $OUT/interference.log 2>&1
echo "interference rc=$? at $(el) s"; python3 -c "
import json; r=json.load(open('$OUT/interference.json'))
d=r['itl_during_prefill_ms']; s=r['steady_itl_ms']['p50']
print('steady ITL p50 %.2f ms; during prefill p50 %.2f p90 %.2f p99 %.2f max %.2f ms; p50/steady %.2fx, p99/steady %.2fx, max/steady %.2fx; long prefill %.0f ms (status %s)' % (
 s, d['p50'], d['p90'], d['p99'], d['max'], d['p50']/s, d['p99']/s, r['max_during_over_steady_p50'], r['long_prefill_ms'], r['long_status']))"
stop
if [ $(el) -lt 250 ]; then
  NAME=chain; SGLANG_SIMULATE_ACC_LEN=6.5 start --speculative-draft-model-path /tmp/q8-dflash --speculative-verify chain
  timeout $(( 310 - $(el) )) python3 deploy/bench/load.py http://127.0.0.1:30000 --concurrency 1,32 \
    --input-len 512 --output-len 256 --waves 1 --ready-timeout 40 --timeout 40 \
    --out $OUT/load-chain-sim.json > $OUT/load-chain-sim.log 2>&1
  echo "load chain-sim rc=$? at $(el) s"; tail -n 3 $OUT/load-chain-sim.log | cut -c1-300
  stop
fi
grep -h -iE "panick|error" $OUT/server-*.log | sed 's/\x1b\[[0-9;]*m//g' | head -4
echo "done at $(el) s"
