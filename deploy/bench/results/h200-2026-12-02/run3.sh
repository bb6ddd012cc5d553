#!/usr/bin/env bash
# Session 9, device call 3: after batching the split-K attention path (chain / tree verify of
# many sequences: one q/k-norm + RoPE launch, one split launch and one merge per layer for the
# whole batch) and the batched-step breakdown (GEMMs alone, a 16-position context): the pooled
# GPU check, the bench (batched figures), plain at 1..256 and DFLASH chain with
# SGLANG_SIMULATE_ACC_LEN=6.5 at 1, 8, 32 through the server.
set -u
mkdir -p /tmp/b && tar -xJf .gpu/bundle.tar.xz -C /tmp/b && . /tmp/b/env.sh
timeout 60 /tmp/b/gpu_check cuda $OUT/pooled.json --pooled > $OUT/pooled.log 2>&1
echo "pooled check rc=$?"; grep "^pooled" $OUT/pooled.log
timeout 250 /tmp/b/dflash-serve bench --variants fast --contexts 1024 --sizes 1,16 --budgets 16 \
  --e2e-tokens 128 --batch-sizes 8,32,64 --out $OUT/bench.json > $OUT/bench.log 2>&1
echo "bench rc=$?"
python3 -c "
import json; d = json.load(open('$OUT/bench.json'))['variants']['fast']
print('decode', d['decode']); print(json.dumps(d.get('batched'), indent=0))"
if [ ! -f /tmp/q8/config.json ]; then
  timeout 150 python3 deploy/bench/random_checkpoint.py --shape qwen3-8b --out /tmp/q8 --drafter /tmp/q8-dflash > $OUT/checkpoint.log 2>&1
  echo "checkpoint regenerated rc=$?"
fi
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
export SGLANG_SIMULATE_ACC_LEN=6.5
serve chain 1,8,32 150 --speculative-draft-model-path /tmp/q8-dflash --speculative-verify chain
