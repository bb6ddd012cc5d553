#!/usr/bin/env bash
# Session 10, device call 1 (main with the prefix cache): the prefix-cache TTFT figure (4K-token
# shared prefix, second request against the first, plain and DFLASH chain), then the issue-17
# plain table again at default flags (the cache is on by default; random prompts never hit it,
# so this checks that it costs nothing and fails nothing), and DFLASH chain with simulated
# acceptance 6.5.
set -u
mkdir -p /tmp/b && tar -xJf .gpu/bundle.tar.xz -C /tmp/b && . /tmp/b/env.sh
t0=$(date +%s)
timeout 150 python3 deploy/bench/random_checkpoint.py --shape qwen3-8b --out /tmp/q8 --drafter /tmp/q8-dflash > $OUT/checkpoint.log 2>&1
echo "checkpoint rc=$? in $(( $(date +%s) - t0 )) s"
start() {  # name, server flags...
  local name=$1; shift
  /tmp/b/dflash-serve --model-path /tmp/q8 --port 30000 "$@" > $OUT/server-$name.log 2>&1 &
  PID=$!
}
stop() { kill -TERM $PID; sleep 2; kill -9 $PID 2>/dev/null; wait $PID 2>/dev/null; }
prefix() {  # name
  timeout 120 python3 deploy/bench/load.py http://127.0.0.1:30000 --shared-prefix 4096 \
    --shared-prefix-repeats 5 --ready-timeout 90 --timeout 60 --out $OUT/prefix-$1.json > $OUT/prefix-$1.log 2>&1
  echo "prefix $1 rc=$?"; python3 -c "
import json; r=json.load(open('$OUT/prefix-$1.json'))
print('prefix $1: cold TTFT p50 %.1f ms, warm %.1f ms, speedup p50 %.2fx, failed %d' % (r['cold_ttft_ms_p50'], r['warm_ttft_ms_p50'], r['speedup_p50'], r['failed']))
for x in r['repeats']: print('  ', x)"
}
load() {  # name, levels, timeout
  timeout $3 python3 deploy/bench/load.py http://127.0.0.1:30000 --concurrency $2 \
    --input-len 512 --output-len 256 --waves 1 --ready-timeout 90 --timeout 150 \
    --out $OUT/load-$1.json > $OUT/load-$1.log 2>&1
  echo "load $1 rc=$?"; cat $OUT/load-$1.log
}
start plain --speculative-algorithm NONE
prefix plain
load plain 1,8,32,64,128,256 200
grep -m3 -E "KV cache pool|prefix cache" $OUT/server-plain.log | sed 's/\x1b\[[0-9;]*m//g'
stop
start plain-nocache --speculative-algorithm NONE --disable-radix-cache
prefix plain-nocache
stop
start chain --speculative-draft-model-path /tmp/q8-dflash --speculative-verify chain
prefix chain
stop
export SGLANG_SIMULATE_ACC_LEN=6.5
start chain-sim --speculative-draft-model-path /tmp/q8-dflash --speculative-verify chain
load chain-sim 1,8,32 150
stop
unset SGLANG_SIMULATE_ACC_LEN
grep -h -iE "panick|error" $OUT/server-*.log | sed 's/\x1b\[[0-9;]*m//g' | head -5
