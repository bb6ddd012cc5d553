#!/usr/bin/env bash
# Session 18, device call F (issue 17): the server after the view-copy fix (d9ff7fe): DFLASH chain
# (SIMULATE 6.5) at c=1..256 (--waves 1) and at c=32 with continuous arrivals (--waves 3), plain
# at c=32 and c=64 --waves 3 for the same comparison.
set -u
D=.gpu-s18f
mkdir -p /tmp/b && tar -xJf $D/bundle.tar.xz -C /tmp/b && . /tmp/b/env.sh
T0=$(date +%s); el() { echo $(( $(date +%s) - T0 )); }
mkdir -p $OUT/x
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee $OUT/x/gpu.txt
[ -d /tmp/q8-dflash ] || timeout 150 python3 deploy/bench/random_checkpoint.py --shape qwen3-8b --out /tmp/q8 --drafter /tmp/q8-dflash > $OUT/x/checkpoint.log 2>&1
echo "checkpoint rc=$? at $(el) s"
export RUST_LOG="info,dflash_serve::steps=debug"
start() { local name=$1; shift; NAME=$name; /tmp/b/dflash-serve --model-path /tmp/q8 --port 30000 "$@" > $OUT/x/server-$name.log 2>&1 & PID=$!; }
stop() { kill -TERM $PID; sleep 2; kill -9 $PID 2>/dev/null; wait $PID 2>/dev/null; }
load() {  # name levels waves timeout
  timeout $4 python3 deploy/bench/load.py http://127.0.0.1:30000 --concurrency $2 --input-len 512 --output-len 256 \
    --waves $3 --ready-timeout 90 --timeout 60 --out $OUT/x/load-$1.json > $OUT/x/load-$1.log 2>&1
  echo "load $1 rc=$? at $(el) s"; grep -E "output tok/s" $OUT/x/load-$1.log
}
export SGLANG_SIMULATE_ACC_LEN=6.5
start chain --speculative-draft-model-path /tmp/q8-dflash --speculative-verify chain
load chain 1,8,32,64,128,256 1 110
load chain-w3 32 3 40
stop
unset SGLANG_SIMULATE_ACC_LEN
start plain --speculative-algorithm NONE
load plain-w3 32,64 3 60
stop
grep -h -iE "panick|error" $OUT/x/server-*.log | sed 's/\x1b\[[0-9;]*m//g' | head -5
tar -C $OUT -cJf $OUT/s18f.tar.xz x && rm -rf $OUT/x
echo "done at $(el) s"
