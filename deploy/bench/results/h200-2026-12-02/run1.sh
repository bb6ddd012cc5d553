#!/usr/bin/env bash
# Session 9, device call 1 (main with the paged K/V pool, page-table kernels and batched
# CUDA graphs): the pooled GPU check (batched decode / chain / tree steps against each
# sequence alone), the batch-1 bench (no regression from the page tables), a random-weight
# Qwen3-8B checkpoint + DFlash drafter, plain decoding through the real server at concurrency
# 1..256 and DFLASH chain with SGLANG_SIMULATE_ACC_LEN=6.5 at 1, 8, 32.
set -u
mkdir -p /tmp/b && tar -xJf .gpu/bundle.tar.xz -C /tmp/b && . /tmp/b/env.sh
nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used --format=csv > $OUT/gpu.txt 2>&1
timeout 60 /tmp/b/gpu_check cuda $OUT/pooled.json --pooled > $OUT/pooled.log 2>&1
echo "pooled check rc=$?"; tail -n 5 $OUT/pooled.log
timeout 250 /tmp/b/dflash-serve bench --e2e-tokens 512 --variants fast --out $OUT/bench.json > $OUT/bench.log 2>&1
echo "bench rc=$?"; grep -i "decode\|chain\|roofline" $OUT/bench.log | head -12
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
  grep -m2 "KV cache pool\|BENCHMARK MODE" $OUT/server-$name.log
}
serve plain 1,8,32,64,128,256 200 --speculative-algorithm NONE
export SGLANG_SIMULATE_ACC_LEN=6.5
serve chain 1,8,32 150 --speculative-draft-model-path /tmp/q8-dflash --speculative-verify chain
