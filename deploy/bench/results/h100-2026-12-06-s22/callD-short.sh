#!/usr/bin/env bash
# Session 22's last 390 s of device time: callD-serve-c32.sh cut to the chain server at c=32
# with the per-sequence and the batched context append (no plain baseline, no c=1).
set -u
D=${D:-.gpu-serve}
mkdir -p /tmp/b && tar -xJf $D/bundle.tar.xz -C /tmp/b && . /tmp/b/env.sh
T0=$(date +%s); el() { echo $(( $(date +%s) - T0 )); }
mkdir -p $OUT/x
timeout 120 python3 deploy/bench/random_checkpoint.py --shape qwen3-8b --out /tmp/q8 --drafter /tmp/q8-dflash > $OUT/x/checkpoint.log 2>&1
echo "checkpoint rc=$? at $(el) s"
export RUST_LOG="info,dflash_serve::steps=debug"
start() { local name=$1; shift; /tmp/b/dflash-serve --model-path /tmp/q8 --port 30000 "$@" > $OUT/x/server-$name.log 2>&1 & PID=$!; }
stop() { kill -TERM $PID; sleep 2; kill -9 $PID 2>/dev/null; wait $PID 2>/dev/null; }
load() {
  timeout $3 python3 deploy/bench/load.py http://127.0.0.1:30000 --concurrency $2 --input-len 512 --output-len 256 \
    --waves 1 --ready-timeout 60 --timeout 50 --out $OUT/x/load-$1.json > $OUT/x/load-$1.log 2>&1
  echo "load $1 rc=$? at $(el) s"; grep -E "output tok/s|fail" $OUT/x/load-$1.log | head -6
}
export SGLANG_SIMULATE_ACC_LEN=6.5
for batched in 0 1; do
  export DFLASH_BATCHED_CONTEXT_APPEND=$batched
  start chain$batched --speculative-draft-model-path /tmp/q8-dflash --speculative-verify chain
  load chain$batched 32 100
  stop
done
echo "done at $(el) s"
