#!/usr/bin/env bash
# Session 11, device call 1: mixed prefill + decode steps (SGLang's mixed chunk, on by
# default): gpu_check --pooled (a mixed batch against each sequence alone), the batched
# end-to-end profile (32 requests in one engine, plain and DFLASH chain at simulated tau 6.5),
# then the 32K-prompt interference run with mixed steps at pieces 256 and 128 and without them
# (--disable-mixed-chunk) at 256, and the plain c=32 load figure with mixed steps.
set -u
mkdir -p /tmp/b && tar -xJf .gpu/bundle.tar.xz -C /tmp/b && . /tmp/b/env.sh
cd /tmp/b
echo "== gpu_check --pooled"
timeout 90 ./gpu_check cuda $OUT/pooled.json --pooled 2>&1 | grep -E "pooled|error|Error" | tail -8
cd - > /dev/null
echo "== bench e2e batched"
timeout 200 /tmp/b/dflash-serve bench --e2e-only --e2e-batch 32 --e2e-profile --budgets 16 \
  --e2e-prompt 512 --e2e-tokens 256 --no-e2e-check --out $OUT/bench.json > $OUT/bench.log 2>&1
echo "bench rc=$?"
python3 - <<'PY'
import json, os
r = json.load(open(os.environ['OUT'] + '/bench.json'))
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
timeout 150 python3 deploy/bench/random_checkpoint.py --shape qwen3-8b --out /tmp/q8 > $OUT/checkpoint.log 2>&1
echo "checkpoint rc=$? in $(( $(date +%s) - t0 )) s"
inter() {  # name, server flags...
  local name=$1; shift
  /tmp/b/dflash-serve --model-path /tmp/q8 --port 30000 --speculative-algorithm NONE "$@" > $OUT/server-$name.log 2>&1 &
  PID=$!
  timeout 140 python3 deploy/bench/load.py http://127.0.0.1:30000 --interference 32768 --interference-streams 16 \
    --output-len 2048 --ready-timeout 90 --timeout 130 --out $OUT/interference-$name.json > $OUT/interference-$name.log 2>&1
  echo "$name rc=$?"; python3 -c "
import json; r=json.load(open('$OUT/interference-$name.json'))
print('$name: steady ITL p50 %.2f ms; during prefill p50 %.2f p90 %.2f p99 %.2f max %.2f ms; max/steady %.2fx; long prefill %.0f ms (status %s)' % (
 r['steady_itl_ms']['p50'], r['itl_during_prefill_ms']['p50'], r['itl_during_prefill_ms']['p90'], r['itl_during_prefill_ms']['p99'], r['itl_during_prefill_ms']['max'], r['max_during_over_steady_p50'], r['long_prefill_ms'], r['long_status']))"
}
stop() { kill -TERM $PID; sleep 2; kill -9 $PID 2>/dev/null; wait $PID 2>/dev/null; }
inter mixed-256
timeout 100 python3 deploy/bench/load.py http://127.0.0.1:30000 --concurrency 1,32 \
    --input-len 512 --output-len 256 --waves 1 --ready-timeout 90 --timeout 90 \
    --out $OUT/load-plain.json > $OUT/load-plain.log 2>&1
echo "load rc=$?"; cat $OUT/load-plain.log | tail -4
stop
inter mixed-128 --prefill-tokens-while-decoding 128
stop
inter separate-256 --disable-mixed-chunk
stop
grep -h -iE "panick|error" $OUT/server-*.log | sed 's/\x1b\[[0-9;]*m//g' | head -5
