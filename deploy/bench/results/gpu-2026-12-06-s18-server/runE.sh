#!/usr/bin/env bash
# Session 18, device call E: (issue 20) the 27B family bench with the split-kernel GDN prefill;
# (issue 17) the server with the start-up warm-up: DFLASH chain (SIMULATE 6.5) at c=32 and c=64
# with the step log (the c=64 cliff), then the 32K interference (plain).
set -u
D=.gpu-s18e
mkdir -p /tmp/b && tar -xJf $D/bundle.tar.xz -C /tmp/b && . /tmp/b/env.sh
T0=$(date +%s); el() { echo $(( $(date +%s) - T0 )); }
mkdir -p $OUT/x
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee $OUT/x/gpu.txt
timeout 150 /tmp/b/dflash-serve bench --model qwen3.6-27b --prefill 4096 --e2e-prompt 1024 --e2e-tokens 192 \
  --budgets 16 --out $OUT/x/h27.json > $OUT/x/h27.log 2>&1
echo "bench 27b rc=$? at $(el) s"
python3 - $OUT/x/h27.json <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
p = r['prefill_4096']; d = r['decode_through_engine']; e = r['e2e']
print('prefill 4096: %.3f s, %.0f tok/s, %.3f of matmul %.0f TF/s' % (p['seconds'], p['tok_per_s'], p['fraction_of_matmul_rate'], r['probes']['matmul_TFLOPs']))
print('decode: %.2f ms/token, %.3f of roofline' % (d['ms_per_token'], d['fraction_of_roofline']))
for k, v in e.items():
    if isinstance(v, dict) and 'tok_per_s' in v: print(k, 'tok/s %.1f speedup %s' % (v['tok_per_s'], v.get('speedup_vs_plain')))
print('kernel_checks', json.dumps(r.get('kernel_checks')))
PY
[ -d /tmp/q8-dflash ] || timeout 150 python3 deploy/bench/random_checkpoint.py --shape qwen3-8b --out /tmp/q8 --drafter /tmp/q8-dflash > $OUT/x/checkpoint.log 2>&1
echo "checkpoint rc=$? at $(el) s"
export RUST_LOG="info,dflash_serve::steps=debug"
start() { local name=$1; shift; NAME=$name; /tmp/b/dflash-serve --model-path /tmp/q8 --port 30000 "$@" > $OUT/x/server-$name.log 2>&1 & PID=$!; }
stop() { kill -TERM $PID; sleep 2; kill -9 $PID 2>/dev/null; wait $PID 2>/dev/null; }
export SGLANG_SIMULATE_ACC_LEN=6.5; start chain --speculative-draft-model-path /tmp/q8-dflash --speculative-verify chain
timeout 80 python3 deploy/bench/load.py http://127.0.0.1:30000 --concurrency 32,64 --input-len 512 --output-len 256 --waves 1 \
  --ready-timeout 90 --timeout 60 --out $OUT/x/load-chain.json > $OUT/x/load-chain.log 2>&1
echo "load chain rc=$? at $(el) s"; grep -E "output tok/s" $OUT/x/load-chain.log
grep -m3 -E "warmed|KV cache pool" $OUT/x/server-chain.log | sed 's/\x1b\[[0-9;]*m//g' | cut -c1-220
stop
unset SGLANG_SIMULATE_ACC_LEN; start interf --speculative-algorithm NONE
timeout 70 python3 deploy/bench/load.py http://127.0.0.1:30000 --interference 32768 --interference-streams 16 \
  --output-len 2048 --ready-timeout 60 --timeout 60 --out $OUT/x/interference.json > $OUT/x/interference.log 2>&1
echo "interference rc=$? at $(el) s"
python3 deploy/bench/results/h200-2026-12-06-s16-interf/analyze.py warm $OUT/x/interference.json $OUT/x/server-interf.log > $OUT/x/interf-summary.txt 2>&1; head -10 $OUT/x/interf-summary.txt
grep -m1 "warmed" $OUT/x/server-interf.log | sed 's/\x1b\[[0-9;]*m//g' | cut -c1-200
stop
grep -h -iE "panick|error" $OUT/x/server-*.log | sed 's/\x1b\[[0-9;]*m//g' | head -5
tar -C $OUT -cJf $OUT/s18e.tar.xz x && rm -rf $OUT/x
echo "done at $(el) s"
