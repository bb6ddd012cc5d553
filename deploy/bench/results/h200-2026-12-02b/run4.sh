#!/usr/bin/env bash
# Session 10, device call 4 (main after merging the issue-21 and issue-18 branches): the CUDA
# build of the merged tree runs its checks: gpu_check --train (the training-engine kernels,
# with the tie-aware argmax criterion not yet run on the GPU), gpu_check --pooled (paged
# attention), and the prefix-cache TTFT once more (plain).
set -u
mkdir -p /tmp/b && tar -xJf .gpu/bundle.tar.xz -C /tmp/b && . /tmp/b/env.sh
echo "== gpu_check --train"
timeout 90 /tmp/b/gpu_check cuda $OUT/train_check.json --train 2>&1 | grep -v '^{"train"' | tail -25
echo "== gpu_check --pooled"
timeout 60 /tmp/b/gpu_check cuda $OUT/pooled.json --pooled > $OUT/pooled.log 2>&1
echo "pooled check rc=$?"; grep "^pooled" $OUT/pooled.log | tail -8
timeout 150 python3 deploy/bench/random_checkpoint.py --shape qwen3-8b --out /tmp/q8 > $OUT/checkpoint.log 2>&1
/tmp/b/dflash-serve --model-path /tmp/q8 --port 30000 --speculative-algorithm NONE > $OUT/server.log 2>&1 &
PID=$!
timeout 100 python3 deploy/bench/load.py http://127.0.0.1:30000 --shared-prefix 4096 --shared-prefix-repeats 3 \
  --ready-timeout 90 --timeout 60 --out $OUT/prefix.json > $OUT/prefix.log 2>&1
echo "prefix rc=$?"; python3 -c "
import json; r=json.load(open('$OUT/prefix.json'))
print('prefix: cold TTFT p50 %.1f ms, warm %.1f ms, speedup p50 %.2fx, failed %d' % (r['cold_ttft_ms_p50'], r['warm_ttft_ms_p50'], r['speedup_p50'], r['failed']))"
kill -TERM $PID; sleep 2; kill -9 $PID 2>/dev/null; wait $PID 2>/dev/null
