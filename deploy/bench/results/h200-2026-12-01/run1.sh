#!/usr/bin/env bash
# Session 8, device call 1 (main after the models/ layout change and the memory-sized K/V
# budget): the issue-16 bench (fused path, e2e included) to compare with the published table,
# then a random-weight Qwen3-8B checkpoint + DFlash drafter for the server load runs, and plain
# decoding through the real server at concurrency 1..256 (deploy/bench/load.py).
set -u
mkdir -p /tmp/b && tar -xJf .gpu/bundle.tar.xz -C /tmp/b && . /tmp/b/env.sh
nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used --format=csv > $OUT/gpu.txt 2>&1
timeout 250 /tmp/b/dflash-serve bench --e2e-tokens 512 --variants fast --out $OUT/bench.json > $OUT/bench.log 2>&1
echo "bench rc=$?"
t0=$(date +%s)
timeout 150 python3 deploy/bench/random_checkpoint.py --shape qwen3-8b --out /tmp/q8 --drafter /tmp/q8-dflash > $OUT/checkpoint.log 2>&1
echo "checkpoint rc=$? in $(( $(date +%s) - t0 )) s"
/tmp/b/dflash-serve --model-path /tmp/q8 --speculative-algorithm NONE --port 30000 > $OUT/server-plain.log 2>&1 &
PID=$!
timeout 160 python3 deploy/bench/load.py http://127.0.0.1:30000 --concurrency 1,8,32,64,128,256 \
  --input-len 512 --output-len 256 --waves 1 --ready-timeout 90 --timeout 150 \
  --out $OUT/load-plain.json > $OUT/load-plain.log 2>&1
echo "load plain rc=$?"
cat $OUT/load-plain.log
kill -TERM $PID; sleep 2; kill -9 $PID 2>/dev/null
grep -m3 "KV cache pool\|max_total_num_tokens" $OUT/server-plain.log
