#!/usr/bin/env bash
# Session 13, device call E: plain at c=32 over 3 waves (the baseline of call D's chain-w3).
set -u
[ -x /tmp/b/dflash-serve ] || { mkdir -p /tmp/b && tar -xJf .gpu/bundle.tar.xz -C /tmp/b; }
. /tmp/b/env.sh
[ -f /tmp/q8/config.json ] || timeout 100 python3 deploy/bench/random_checkpoint.py --shape qwen3-8b --out /tmp/q8 --drafter /tmp/q8-dflash > $OUT/checkpoint.log 2>&1
/tmp/b/dflash-serve --model-path /tmp/q8 --port 30000 --speculative-algorithm NONE > $OUT/server-plain-w3.log 2>&1 & PID=$!
timeout 120 python3 deploy/bench/load.py http://127.0.0.1:30000 --concurrency 32 \
  --input-len 512 --output-len 256 --waves 3 --ready-timeout 90 --timeout 100 \
  --out $OUT/load-plain-w3.json > $OUT/load-plain-w3.log 2>&1
echo "load plain-w3 rc=$?"; tail -n 2 $OUT/load-plain-w3.log
kill -TERM $PID; sleep 2; kill -9 $PID 2>/dev/null
