#!/usr/bin/env bash
# Session 18, device call A2 (issue 17): the server table again with the burst rule (a burst of
# waiting prompts goes at the chunk size), plain and chain (SIMULATE 6.5) at c=1..256, then the
# 32K interference with the default lazy CUDA module loading and with CUDA_MODULE_LOADING=EAGER.
set -u
D=.gpu-s18d
mkdir -p /tmp/b && tar -xJf $D/bundle.tar.xz -C /tmp/b && . /tmp/b/env.sh
T0=$(date +%s); el() { echo $(( $(date +%s) - T0 )); }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee $OUT/gpu.txt
[ -d /tmp/q8-dflash ] || timeout 150 python3 deploy/bench/random_checkpoint.py --shape qwen3-8b --out /tmp/q8 --drafter /tmp/q8-dflash > $OUT/checkpoint.log 2>&1
echo "checkpoint rc=$? at $(el) s"
mkdir -p $OUT/logs
start() { local name=$1; shift; NAME=$name; /tmp/b/dflash-serve --model-path /tmp/q8 --port 30000 "$@" > $OUT/logs/server-$name.log 2>&1 & PID=$!; }
stop() { kill -TERM $PID; sleep 2; kill -9 $PID 2>/dev/null; wait $PID 2>/dev/null; }
load() {  # levels, timeout
  timeout $2 python3 deploy/bench/load.py http://127.0.0.1:30000 --concurrency $1 \
    --input-len 512 --output-len 256 --waves 1 --ready-timeout 90 --timeout 120 \
    --out $OUT/load-$NAME.json > $OUT/logs/load-$NAME.log 2>&1
  echo "load $NAME rc=$? at $(el) s"; grep -E "output tok/s|fail" $OUT/logs/load-$NAME.log | head -8
}
start plain --speculative-algorithm NONE
load 1,8,32,64,128,256 100
stop
export SGLANG_SIMULATE_ACC_LEN=6.5
start chain --speculative-draft-model-path /tmp/q8-dflash --speculative-verify chain
load 1,8,32,64,128,256 110
stop
start tree16 --speculative-draft-model-path /tmp/q8-dflash --speculative-ddtree-budget 16
load 1,32 50
stop
start tree64 --speculative-draft-model-path /tmp/q8-dflash --speculative-ddtree-budget 64
load 1,32 50
stop
unset SGLANG_SIMULATE_ACC_LEN
export RUST_LOG="info,dflash_serve::steps=debug"
for mode in lazy eager; do
  [ $mode = eager ] && export CUDA_MODULE_LOADING=EAGER
  start interf-$mode --speculative-algorithm NONE
  timeout 75 python3 deploy/bench/load.py http://127.0.0.1:30000 --interference 32768 --interference-streams 16 \
    --output-len 2048 --ready-timeout 60 --timeout 70 --out $OUT/interference-$mode.json > $OUT/logs/interference-$mode.log 2>&1
  echo "interference $mode rc=$? at $(el) s"
  python3 deploy/bench/results/h200-2026-12-06-s16-interf/analyze.py $mode $OUT/interference-$mode.json $OUT/logs/server-interf-$mode.log > $OUT/interf-summary-$mode.txt 2>&1; head -12 $OUT/interf-summary-$mode.txt
  stop
done
grep -h -iE "panick|error" $OUT/logs/server-*.log | sed 's/\x1b\[[0-9;]*m//g' | head -5
tar -C $OUT -cJf $OUT/logs.tar.xz logs && rm -rf $OUT/logs
echo "done at $(el) s"
