#!/usr/bin/env bash
# Session 13, device call A: the drafter's context K/V in a paged pool. gpu_check --pooled
# (target decode/chain/tree/mixed + the pooled drafter batch and round graph), the batched e2e
# profile (32 requests in one engine, plain and chain at simulated tau 6.5), then the server on
# a random Qwen3-8B + drafter: DFLASH chain SIMULATE 6.5 at c=1,32, DDTree-16 at c=32, plain
# at c=1,32.
set -u
mkdir -p /tmp/b && tar -xJf .gpu/bundle.tar.xz -C /tmp/b && . /tmp/b/env.sh
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader
echo "== gpu_check --pooled"
( cd /tmp/b && timeout 100 ./gpu_check cuda $OUT/pooled.json --pooled 2>&1 | grep -E "pooled|error|Error|panick" | tail -12 )
echo "== bench e2e batched"
timeout 150 /tmp/b/dflash-serve bench --e2e-only --e2e-batch 32 --e2e-profile --budgets 16 \
  --e2e-prompt 512 --e2e-tokens 256 --no-e2e-check --out $OUT/bench.json > $OUT/bench.log 2>&1
echo "bench rc=$?"; tail -n 3 $OUT/bench.log
python3 - <<'PY'
import json, os
try:
    r = json.load(open(os.environ['OUT'] + '/bench.json'))
except Exception as e:
    print('no bench.json', e); raise SystemExit
def walk(x):
    if isinstance(x, dict):
        if 'e2e_batched' in x: return x['e2e_batched']
        for v in x.values():
            w = walk(v)
            if w: return w
b = walk(r)
for name in ('plain', 'chain'):
    e = b[name]; print(name, 'tok/s %.0f steps %s' % (e['tok_per_s'], e['steps']), 'speedup %.2f' % e.get('speedup_vs_plain', 1))
    for ph, t in sorted(e.get('phases', {}).items()):
        if ph != 'run': print('   %-28s %8.3f ms/step  count %6d  mean %.3f  max %.2f' % (ph, t['ms_per_step'], t['count'], t['mean_ms'], t['max_ms']))
    if 'phases' in e: print('   profiled run', e['phases']['run'])
PY
t0=$(date +%s)
timeout 150 python3 deploy/bench/random_checkpoint.py --shape qwen3-8b --out /tmp/q8 --drafter /tmp/q8-dflash > $OUT/checkpoint.log 2>&1
echo "checkpoint rc=$? in $(( $(date +%s) - t0 )) s"
start() { local name=$1; shift; /tmp/b/dflash-serve --model-path /tmp/q8 --port 30000 "$@" > $OUT/server-$name.log 2>&1 & PID=$!; }
stop() { kill -TERM $PID; sleep 2; kill -9 $PID 2>/dev/null; wait $PID 2>/dev/null; }
load() {
  timeout $3 python3 deploy/bench/load.py http://127.0.0.1:30000 --concurrency $2 \
    --input-len 512 --output-len 256 --waves 1 --ready-timeout 90 --timeout 120 \
    --out $OUT/load-$1.json > $OUT/load-$1.log 2>&1
  echo "load $1 rc=$?"; tail -n 4 $OUT/load-$1.log
}
export SGLANG_SIMULATE_ACC_LEN=6.5
start chain-sim --speculative-draft-model-path /tmp/q8-dflash --speculative-verify chain
load chain-sim 1,32 130
grep -m3 -E "KV cache pool|drafter" $OUT/server-chain-sim.log | sed 's/\x1b\[[0-9;]*m//g' | cut -c1-300
stop
unset SGLANG_SIMULATE_ACC_LEN
start plain --speculative-algorithm NONE
load plain 1,32 80
stop
inter() {  # name, server flags...
  local name=$1; shift
  start $name --speculative-algorithm NONE "$@"
  timeout 130 python3 deploy/bench/load.py http://127.0.0.1:30000 --interference 32768 --interference-streams 16 \
    --output-len 2048 --ready-timeout 90 --timeout 120 --out $OUT/interference-$name.json > $OUT/interference-$name.log 2>&1
  echo "$name rc=$?"; python3 -c "
import json; r=json.load(open('$OUT/interference-$name.json'))
print('$name: steady ITL p50 %.2f ms; during prefill p50 %.2f p90 %.2f p99 %.2f max %.2f ms; max/steady %.2fx; long prefill %.0f ms (status %s)' % (
 r['steady_itl_ms']['p50'], r['itl_during_prefill_ms']['p50'], r['itl_during_prefill_ms']['p90'], r['itl_during_prefill_ms']['p99'], r['itl_during_prefill_ms']['max'], r['max_during_over_steady_p50'], r['long_prefill_ms'], r['long_status']))"
  stop
}
inter mixed-256
grep -h -iE "panick|error" $OUT/server-*.log | sed 's/\x1b\[[0-9;]*m//g' | head -5
