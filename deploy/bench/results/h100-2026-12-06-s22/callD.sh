#!/usr/bin/env bash
# Issue 17 (bundle: dflash-serve + gpu_check, built at or after session 21's batched context
# append): `gpu_check --pooled` (the batched append against each sequence alone), then the
# DFLASH chain server (SIMULATE 6.5, Qwen3-8B-shaped random weights) at c=1,32 with the
# per-sequence append and with DFLASH_BATCHED_CONTEXT_APPEND=1, and plain at c=1,32 (the
# table's baseline, same call). On an H200 this is also the re-measurement the issue asks for;
# make the batched append the default (models/src/cuda/mod.rs) if it passes and is faster.
set -u
D=${D:-.gpu-serve}
mkdir -p /tmp/b && tar -xJf $D/bundle.tar.xz -C /tmp/b && . /tmp/b/env.sh
T0=$(date +%s); el() { echo $(( $(date +%s) - T0 )); }
mkdir -p $OUT/x
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee $OUT/x/gpu.txt
export DFLASH_TESTS_DIR=$PWD/tests
( cd /tmp/b && timeout 120 ./gpu_check cuda $OUT/x/pooled.json --pooled > $OUT/x/pooled.log 2>&1; echo "gpu_check --pooled rc=$? at $(el) s" )
grep -E "pooled drafter" $OUT/x/pooled.log | cut -c1-200
timeout 150 python3 deploy/bench/random_checkpoint.py --shape qwen3-8b --out /tmp/q8 --drafter /tmp/q8-dflash > $OUT/x/checkpoint.log 2>&1
echo "checkpoint rc=$? at $(el) s"
export RUST_LOG="info,dflash_serve::steps=debug"
start() { local name=$1; shift; /tmp/b/dflash-serve --model-path /tmp/q8 --port 30000 "$@" > $OUT/x/server-$name.log 2>&1 & PID=$!; }
stop() { kill -TERM $PID; sleep 2; kill -9 $PID 2>/dev/null; wait $PID 2>/dev/null; }
load() {  # name levels timeout
  timeout $3 python3 deploy/bench/load.py http://127.0.0.1:30000 --concurrency $2 --input-len 512 --output-len 256 \
    --waves 1 --ready-timeout 90 --timeout 60 --out $OUT/x/load-$1.json > $OUT/x/load-$1.log 2>&1
  echo "load $1 rc=$? at $(el) s"; grep -E "output tok/s|fail" $OUT/x/load-$1.log | head -6
}
start plain --speculative-algorithm NONE
load plain 1,32 60
stop
export SGLANG_SIMULATE_ACC_LEN=6.5
for batched in 0 1; do
  export DFLASH_BATCHED_CONTEXT_APPEND=$batched
  start chain$batched --speculative-draft-model-path /tmp/q8-dflash --speculative-verify chain
  load chain$batched 1,32 90
  stop
done
grep -h -iE "panick|error" $OUT/x/server-*.log | sed 's/\x1b\[[0-9;]*m//g' | head -5
tar -C $OUT -cJf $OUT/serve.tar.xz x && rm -rf $OUT/x
echo "done at $(el) s"
