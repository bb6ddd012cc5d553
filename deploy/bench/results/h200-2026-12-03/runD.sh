#!/usr/bin/env bash
# Session 13, device call D (main at dab7eec): DDTree-16 and DDTree-64 with simulated acceptance
# 6.5 (trees from the peaked profile now) at c=1,32, and the chain at c=32 over 3 waves (the
# server's steady state beside call A's single wave).
set -u
mkdir -p /tmp/b && tar -xJf .gpu/bundle.tar.xz -C /tmp/b && . /tmp/b/env.sh
timeout 100 python3 deploy/bench/random_checkpoint.py --shape qwen3-8b --out /tmp/q8 --drafter /tmp/q8-dflash > $OUT/checkpoint.log 2>&1
echo "checkpoint rc=$?"
export SGLANG_SIMULATE_ACC_LEN=6.5
run() {  # name, levels, waves, timeout, flags...
  local name=$1 levels=$2 waves=$3 t=$4; shift 4
  /tmp/b/dflash-serve --model-path /tmp/q8 --port 30000 --speculative-draft-model-path /tmp/q8-dflash "$@" > $OUT/server-$name.log 2>&1 & PID=$!
  timeout $t python3 deploy/bench/load.py http://127.0.0.1:30000 --concurrency $levels \
    --input-len 512 --output-len 256 --waves $waves --ready-timeout 90 --timeout 100 \
    --out $OUT/load-$name.json > $OUT/load-$name.log 2>&1
  echo "load $name rc=$?"; tail -n 3 $OUT/load-$name.log
  sed 's/\x1b\[[0-9;]*m//g' $OUT/server-$name.log | grep "Decode batch" | grep -o "running-req: [0-9]*\|accept len: [0-9.]*\|cuda graph: [A-Za-z]*" | sort | uniq -c | sort -rn | head -6
  kill -TERM $PID; sleep 2; kill -9 $PID 2>/dev/null; wait $PID 2>/dev/null
}
run tree16 1,32 1 100 --speculative-verify ddtree --speculative-ddtree-budget 16
run tree64 1,32 1 110 --speculative-verify ddtree --speculative-ddtree-budget 64
run chain-w3 32 3 110 --speculative-verify chain
grep -h -iE "panick|error" $OUT/server-*.log | sed 's/\x1b\[[0-9;]*m//g' | head -5
