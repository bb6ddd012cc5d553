#!/usr/bin/env bash
# Session 8, device call 2 (right after call 1, same warm machine: /tmp/q8 and /tmp/q8-dflash
# are still there; regenerated if not): DFLASH through the real server with SGLang's
# SGLANG_SIMULATE_ACC_LEN=6.5 (random weights), chain, DDTree-16 and DDTree-64, and plain
# decoding at concurrency 1 again in the same call as the baseline of the speedups.
set -u
mkdir -p /tmp/b && tar -xJf .gpu/bundle.tar.xz -C /tmp/b && . /tmp/b/env.sh
if [ ! -f /tmp/q8-dflash/model.safetensors ]; then
  timeout 150 python3 deploy/bench/random_checkpoint.py --shape qwen3-8b --out /tmp/q8 --drafter /tmp/q8-dflash > $OUT/checkpoint.log 2>&1
  echo "checkpoint regenerated rc=$?"
fi
serve() {  # name, load levels, timeout, server flags...
  local name=$1 levels=$2 tmo=$3; shift 3
  SGLANG_SIMULATE_ACC_LEN=6.5 /tmp/b/dflash-serve --model-path /tmp/q8 --port 30000 "$@" > $OUT/server-$name.log 2>&1 &
  local pid=$!
  timeout $tmo python3 deploy/bench/load.py http://127.0.0.1:30000 --concurrency $levels \
    --input-len 512 --output-len 256 --waves 1 --ready-timeout 90 --timeout 150 \
    --out $OUT/load-$name.json > $OUT/load-$name.log 2>&1
  echo "load $name rc=$?"; cat $OUT/load-$name.log
  kill -TERM $pid; sleep 2; kill -9 $pid 2>/dev/null; wait $pid 2>/dev/null
}
serve plain1 1 60 --speculative-algorithm NONE
# Chunked prefill: 16 plain streams decode while a 32K-token prompt arrives.
/tmp/b/dflash-serve --model-path /tmp/q8 --port 30000 --speculative-algorithm NONE > $OUT/server-interference.log 2>&1 &
PID=$!
timeout 100 python3 deploy/bench/load.py http://127.0.0.1:30000 --interference 32768 --interference-streams 16 \
  --output-len 1024 --ready-timeout 90 --timeout 90 --out $OUT/interference.json > $OUT/interference.log 2>&1
echo "interference rc=$?"; grep -A1 "long_prefill_ms\|max_during" $OUT/interference.log
kill -TERM $PID; sleep 2; kill -9 $PID 2>/dev/null; wait $PID 2>/dev/null
serve chain 1,8,32 200 --speculative-draft-model-path /tmp/q8-dflash --speculative-verify chain
serve ddtree16 1,32 130 --speculative-draft-model-path /tmp/q8-dflash --speculative-verify ddtree --speculative-ddtree-budget 16
serve ddtree64 1,32 130 --speculative-draft-model-path /tmp/q8-dflash --speculative-verify ddtree --speculative-ddtree-budget 64
grep -m2 "BENCHMARK MODE\|KV cache pool" $OUT/server-chain.log
