#!/usr/bin/env bash
# Session 9, device call 5 (main after merging the SGLang drop-in work, long prompts in shrinking pieces while
# others decode, default 256): the issue-17 server tables in one call, default flags except the model path:
# plain at 1..256, the 32K-prompt interference run, DFLASH chain / DDTree-16 / DDTree-64 with
# SGLANG_SIMULATE_ACC_LEN=6.5; then the pooled GPU check.
set -u
mkdir -p /tmp/b && tar -xJf .gpu/bundle.tar.xz -C /tmp/b && . /tmp/b/env.sh
t0=$(date +%s)
timeout 150 python3 deploy/bench/random_checkpoint.py --shape qwen3-8b --out /tmp/q8 --drafter /tmp/q8-dflash > $OUT/checkpoint.log 2>&1
echo "checkpoint rc=$? in $(( $(date +%s) - t0 )) s"
serve() {  # name, load levels, timeout, server flags...
  local name=$1 levels=$2 tmo=$3; shift 3
  /tmp/b/dflash-serve --model-path /tmp/q8 --port 30000 "$@" > $OUT/server-$name.log 2>&1 &
  local pid=$!
  timeout $tmo python3 deploy/bench/load.py http://127.0.0.1:30000 --concurrency $levels \
    --input-len 512 --output-len 256 --waves 1 --ready-timeout 90 --timeout 150 \
    --out $OUT/load-$name.json > $OUT/load-$name.log 2>&1
  echo "load $name rc=$?"; cat $OUT/load-$name.log
  kill -TERM $pid; sleep 2; kill -9 $pid 2>/dev/null; wait $pid 2>/dev/null
}
serve plain 1,8,32,64,128,256 200 --speculative-algorithm NONE
grep -m1 "KV cache pool" $OUT/server-plain.log | sed 's/\x1b\[[0-9;]*m//g'
/tmp/b/dflash-serve --model-path /tmp/q8 --port 30000 --speculative-algorithm NONE > $OUT/server-interference.log 2>&1 &
PID=$!
timeout 120 python3 deploy/bench/load.py http://127.0.0.1:30000 --interference 32768 --interference-streams 16 \
  --output-len 1024 --ready-timeout 90 --timeout 110 --out $OUT/interference.json > $OUT/interference.log 2>&1
echo "interference rc=$?"; cat $OUT/interference.log | tail -n 8
kill -TERM $PID; sleep 2; kill -9 $PID 2>/dev/null; wait $PID 2>/dev/null
export SGLANG_SIMULATE_ACC_LEN=6.5
serve chain 1,8,32 150 --speculative-draft-model-path /tmp/q8-dflash --speculative-verify chain
unset SGLANG_SIMULATE_ACC_LEN
timeout 60 /tmp/b/gpu_check cuda $OUT/pooled.json --pooled > $OUT/pooled.log 2>&1
echo "pooled check rc=$?"; grep "^pooled" $OUT/pooled.log
