#!/usr/bin/env bash
# Session 9, device call 2: the pooled GPU check, the batched-step bench (B = 8, 32, 64
# pooled sequences at 1K context: decode and chain-16, CUDA graph on and off, against the
# step's memory roofline), then plain decoding through the server at 32..256 with the new
# --max-running-requests default (256).
set -u
mkdir -p /tmp/b && tar -xJf .gpu/bundle.tar.xz -C /tmp/b && . /tmp/b/env.sh
timeout 250 /tmp/b/dflash-serve bench --variants fast --contexts 1024 --sizes 1,16 --budgets 16 \
  --e2e-tokens 128 --batch-sizes 8,32,64 --out $OUT/bench.json > $OUT/bench.log 2>&1
echo "bench rc=$?"; grep "batched b=" $OUT/bench.log
if [ ! -f /tmp/q8/model.safetensors ] && [ ! -f /tmp/q8/model.safetensors.index.json ]; then
  timeout 150 python3 deploy/bench/random_checkpoint.py --shape qwen3-8b --out /tmp/q8 --drafter /tmp/q8-dflash > $OUT/checkpoint.log 2>&1
  echo "checkpoint regenerated rc=$?"
fi
/tmp/b/dflash-serve --model-path /tmp/q8 --port 30000 --speculative-algorithm NONE > $OUT/server-plain.log 2>&1 &
PID=$!
timeout 200 python3 deploy/bench/load.py http://127.0.0.1:30000 --concurrency 32,64,128,256 \
  --input-len 512 --output-len 256 --waves 1 --ready-timeout 90 --timeout 150 \
  --out $OUT/load-plain.json > $OUT/load-plain.log 2>&1
echo "load plain rc=$?"; cat $OUT/load-plain.log
kill -TERM $PID; sleep 2; kill -9 $PID 2>/dev/null; wait $PID 2>/dev/null
timeout 60 /tmp/b/gpu_check cuda $OUT/pooled.json --pooled > $OUT/pooled.log 2>&1
echo "pooled check rc=$?"; tail -n 6 $OUT/pooled.log
