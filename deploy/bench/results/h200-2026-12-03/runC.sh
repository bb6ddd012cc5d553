#!/usr/bin/env bash
# Session 13, device call C: the batched e2e profile (call A's timed out at 150 s) and DDTree-16
# with simulated acceptance at c=1,32 on the server.
set -u
[ -x /tmp/b/dflash-serve ] || { mkdir -p /tmp/b && tar -xJf .gpu/bundle.tar.xz -C /tmp/b; }
. /tmp/b/env.sh
t0=$(date +%s)
RUST_LOG=info timeout 330 /tmp/b/dflash-serve bench --e2e-only --e2e-batch 32 --e2e-profile --budgets 16 \
  --e2e-prompt 512 --e2e-tokens 256 --no-e2e-check --out $OUT/bench.json > $OUT/bench.log 2>&1
echo "bench rc=$? in $(( $(date +%s) - t0 )) s"; sed 's/\x1b\[[0-9;]*m//g' $OUT/bench.log | cut -c1-200 | tail -n 12
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
[ -f /tmp/q8/config.json ] || timeout 100 python3 deploy/bench/random_checkpoint.py --shape qwen3-8b --out /tmp/q8 --drafter /tmp/q8-dflash > $OUT/checkpoint.log 2>&1
export SGLANG_SIMULATE_ACC_LEN=6.5
/tmp/b/dflash-serve --model-path /tmp/q8 --port 30000 --speculative-draft-model-path /tmp/q8-dflash --speculative-verify ddtree --speculative-ddtree-budget 16 > $OUT/server-tree16.log 2>&1 & PID=$!
timeout 110 python3 deploy/bench/load.py http://127.0.0.1:30000 --concurrency 1,32 \
    --input-len 512 --output-len 256 --waves 1 --ready-timeout 90 --timeout 100 \
    --out $OUT/load-tree16-sim.json > $OUT/load-tree16-sim.log 2>&1
echo "load tree16-sim rc=$?"; tail -n 3 $OUT/load-tree16-sim.log
kill -TERM $PID; sleep 2; kill -9 $PID 2>/dev/null
