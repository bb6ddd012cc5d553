#!/usr/bin/env bash
# Session 18, device call A (issue 17): the server table at default flags on a random Qwen3-8B
# (+ random 5-layer drafter): plain and DFLASH chain (SGLANG_SIMULATE_ACC_LEN=6.5) at
# c=1,8,32,64,128,256, DDTree-16 / DDTree-64 at c=1,32, then the 32K interference (plain).
set -u
D=.gpu-s18a
mkdir -p /tmp/b && tar -xJf $D/bundle.tar.xz -C /tmp/b && . /tmp/b/env.sh
T0=$(date +%s); el() { echo $(( $(date +%s) - T0 )); }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee $OUT/gpu.txt
timeout 150 python3 deploy/bench/random_checkpoint.py --shape qwen3-8b --out /tmp/q8 --drafter /tmp/q8-dflash > $OUT/checkpoint.log 2>&1
echo "checkpoint rc=$? at $(el) s"
start() { local name=$1; shift; NAME=$name; /tmp/b/dflash-serve --model-path /tmp/q8 --port 30000 "$@" > $OUT/server-$name.log 2>&1 & PID=$!; }
stop() { kill -TERM $PID; sleep 2; kill -9 $PID 2>/dev/null; wait $PID 2>/dev/null; }
load() {  # levels, timeout
  timeout $2 python3 deploy/bench/load.py http://127.0.0.1:30000 --concurrency $1 \
    --input-len 512 --output-len 256 --waves 1 --ready-timeout 90 --timeout 120 \
    --out $OUT/load-$NAME.json > $OUT/load-$NAME.log 2>&1
  echo "load $NAME rc=$? at $(el) s"; grep -E "output tok/s|fail" $OUT/load-$NAME.log | head -8
  grep -m2 -E "max_total_num_tokens|KV cache pool" $OUT/server-$NAME.log | sed 's/\x1b\[[0-9;]*m//g' | cut -c1-240
}
start plain --speculative-algorithm NONE
load 1,8,32,64,128,256 110
stop
export SGLANG_SIMULATE_ACC_LEN=6.5
start chain --speculative-draft-model-path /tmp/q8-dflash --speculative-verify chain
load 1,8,32,64,128,256 120
grep -m2 "accept len" $OUT/server-chain.log | sed 's/\x1b\[[0-9;]*m//g' | cut -c1-240
stop
start tree16 --speculative-draft-model-path /tmp/q8-dflash --speculative-ddtree-budget 16
load 1,32 60
stop
start tree64 --speculative-draft-model-path /tmp/q8-dflash --speculative-ddtree-budget 64
load 1,32 60
grep -m2 "accept len" $OUT/server-tree64.log | sed 's/\x1b\[[0-9;]*m//g' | cut -c1-240
stop
unset SGLANG_SIMULATE_ACC_LEN
echo "== interference at $(el) s"
export RUST_LOG="info,dflash_serve::steps=debug"; start interf --speculative-algorithm NONE
timeout $(( 560 - $(el) > 100 ? 100 : 560 - $(el) )) python3 deploy/bench/load.py http://127.0.0.1:30000 --interference 32768 --interference-streams 16 \
  --output-len 2048 --ready-timeout 60 --timeout 90 --out $OUT/interference.json > $OUT/interference.log 2>&1
echo "interference rc=$? at $(el) s"
python3 deploy/bench/results/h200-2026-12-06-s16-interf/analyze.py interf $OUT/interference.json $OUT/server-interf.log > $OUT/interf-summary.txt 2>&1; head -30 $OUT/interf-summary.txt
stop
xz -9 $OUT/server-interf.log
grep -h -iE "panick|error" $OUT/server-*.log | sed 's/\x1b\[[0-9;]*m//g' | head -5
echo "done at $(el) s"
