#!/usr/bin/env bash
# Issue 17's H200 table in one call (session 19's runA.sh, h100-2026-12-06-s19/, with the bundle
# dir as D): plain and DFLASH chain (SIMULATE 6.5) at c=1..256, DDTree-16/64 at c=1,32, then the
# 32K-token prompt beside 16 decoding streams (chunked prefill). Random Qwen3-8B + random 5-layer
# drafter, `load.py --input-len 512 --output-len 256 --waves 1`, default flags but the named.
# Bundle: dflash-serve + gpu_check of main. ~580 s.
set -u
D=${D:-.gpu-next}
mkdir -p /tmp/b && tar -xJf $D/bundle.tar.xz -C /tmp/b && . /tmp/b/env.sh
T0=$(date +%s); el() { echo $(( $(date +%s) - T0 )); }
mkdir -p $OUT/x
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee $OUT/x/gpu.txt
[ -d /tmp/q8-dflash ] || timeout 150 python3 deploy/bench/random_checkpoint.py --shape qwen3-8b --out /tmp/q8 --drafter /tmp/q8-dflash > $OUT/x/checkpoint.log 2>&1
echo "checkpoint rc=$? at $(el) s"
export RUST_LOG="info,dflash_serve::steps=debug"
start() { local name=$1; shift; NAME=$name; /tmp/b/dflash-serve --model-path /tmp/q8 --port 30000 "$@" > $OUT/x/server-$name.log 2>&1 & PID=$!; }
stop() { kill -TERM $PID; sleep 2; kill -9 $PID 2>/dev/null; wait $PID 2>/dev/null; }
load() {  # name levels timeout
  timeout $3 python3 deploy/bench/load.py http://127.0.0.1:30000 --concurrency $2 --input-len 512 --output-len 256 \
    --waves 1 --ready-timeout 90 --timeout 60 --out $OUT/x/load-$1.json > $OUT/x/load-$1.log 2>&1
  echo "load $1 rc=$? at $(el) s"; grep -E "output tok/s|fail" $OUT/x/load-$1.log | head -8
}
start plain --speculative-algorithm NONE
load plain 1,8,32,64,128,256 100
stop
grep -hE "loaded .* kernel modules|warmed|max_total_num_tokens|capture" $OUT/x/server-plain.log | sed 's/\x1b\[[0-9;]*m//g' | head -6 | cut -c1-220
export SGLANG_SIMULATE_ACC_LEN=6.5
start chain --speculative-draft-model-path /tmp/q8-dflash --speculative-verify chain
load chain 1,8,32,64,128,256 110
stop
grep -hE "capture" $OUT/x/server-chain.log | sed 's/\x1b\[[0-9;]*m//g' | head -6 | cut -c1-220
start tree16 --speculative-draft-model-path /tmp/q8-dflash --speculative-ddtree-budget 16
load tree16 1,32 50
stop
start tree64 --speculative-draft-model-path /tmp/q8-dflash --speculative-ddtree-budget 64
load tree64 1,32 50
stop
unset SGLANG_SIMULATE_ACC_LEN
left=$(( 585 - $(el) )); if [ $left -gt 60 ]; then
  start interf --speculative-algorithm NONE
  timeout $(( left - 10 )) python3 deploy/bench/load.py http://127.0.0.1:30000 --interference 32768 --interference-streams 16 \
    --output-len 2048 --ready-timeout 60 --timeout 70 --out $OUT/x/interference.json > $OUT/x/interference.log 2>&1
  echo "interference rc=$? at $(el) s"
  python3 deploy/bench/results/h200-2026-12-06-s16-interf/analyze.py lazy $OUT/x/interference.json $OUT/x/server-interf.log > $OUT/x/interf-summary.txt 2>&1; head -12 $OUT/x/interf-summary.txt
  stop
fi
grep -h -iE "panick|error" $OUT/x/server-*.log | sed 's/\x1b\[[0-9;]*m//g' | head -5
tar -C $OUT -cJf $OUT/x.tar.xz x && rm -rf $OUT/x
echo "done at $(el) s"
