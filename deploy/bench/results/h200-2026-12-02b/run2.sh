#!/usr/bin/env bash
# Session 10, device call 2 (the prefix cache's drafter features kept on the GPU instead of
# copied to the host, and admission by the new-token ratio): DFLASH chain 4K shared-prefix
# TTFT, DFLASH chain with simulated acceptance 6.5 at 1, 8, 32 (call 1 had regressed against
# session 9: TTFT 23 -> 56 ms at c=1), plain at 64..256 again.
set -u
mkdir -p /tmp/b && tar -xJf .gpu/bundle.tar.xz -C /tmp/b && . /tmp/b/env.sh
t0=$(date +%s)
timeout 150 python3 deploy/bench/random_checkpoint.py --shape qwen3-8b --out /tmp/q8 --drafter /tmp/q8-dflash > $OUT/checkpoint.log 2>&1
echo "checkpoint rc=$? in $(( $(date +%s) - t0 )) s"
start() { local name=$1; shift; /tmp/b/dflash-serve --model-path /tmp/q8 --port 30000 "$@" > $OUT/server-$name.log 2>&1 & PID=$!; }
stop() { kill -TERM $PID; sleep 2; kill -9 $PID 2>/dev/null; wait $PID 2>/dev/null; }
prefix() {
  timeout 120 python3 deploy/bench/load.py http://127.0.0.1:30000 --shared-prefix 4096 \
    --shared-prefix-repeats 5 --ready-timeout 90 --timeout 60 --out $OUT/prefix-$1.json > $OUT/prefix-$1.log 2>&1
  echo "prefix $1 rc=$?"; python3 -c "
import json; r=json.load(open('$OUT/prefix-$1.json'))
print('prefix $1: cold TTFT p50 %.1f ms, warm %.1f ms, speedup p50 %.2fx, failed %d, warm cached %s' % (r['cold_ttft_ms_p50'], r['warm_ttft_ms_p50'], r['speedup_p50'], r['failed'], [x.get('warm_cached_tokens') for x in r['repeats']]))"
}
load() {
  timeout $3 python3 deploy/bench/load.py http://127.0.0.1:30000 --concurrency $2 \
    --input-len 512 --output-len 256 --waves 1 --ready-timeout 90 --timeout 150 \
    --out $OUT/load-$1.json > $OUT/load-$1.log 2>&1
  echo "load $1 rc=$?"; cat $OUT/load-$1.log
}
start chain --speculative-draft-model-path /tmp/q8-dflash --speculative-verify chain
prefix chain
stop
grep -m2 -E "KV cache pool|prefix cache" $OUT/server-chain.log | sed 's/\x1b\[[0-9;]*m//g'
export SGLANG_SIMULATE_ACC_LEN=6.5
start chain-sim --speculative-draft-model-path /tmp/q8-dflash --speculative-verify chain
load chain-sim 1,8,32 150
stop
start chain-sim-nocache --speculative-draft-model-path /tmp/q8-dflash --speculative-verify chain --disable-radix-cache
load chain-sim-nocache 1,8,32 150
stop
unset SGLANG_SIMULATE_ACC_LEN
start plain --speculative-algorithm NONE
load plain 64,128,256 150
stop
start plain-nocache --speculative-algorithm NONE --disable-radix-cache
load plain-nocache 64,128,256 150
stop
grep -h -iE "panick|error" $OUT/server-*.log | sed 's/\x1b\[[0-9;]*m//g' | head -5
