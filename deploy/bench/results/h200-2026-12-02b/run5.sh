#!/usr/bin/env bash
# Session 10, device call 5 (7c92653): the merged main's server on the random checkpoint
# (structured output off with a warning), the prefix-cache TTFT once more.
set -u
mkdir -p /tmp/b && tar -xJf .gpu/bundle.tar.xz -C /tmp/b && . /tmp/b/env.sh
timeout 150 python3 deploy/bench/random_checkpoint.py --shape qwen3-8b --out /tmp/q8 > $OUT/checkpoint.log 2>&1
/tmp/b/dflash-serve --model-path /tmp/q8 --port 30000 --speculative-algorithm NONE > $OUT/server.log 2>&1 &
PID=$!
timeout 100 python3 deploy/bench/load.py http://127.0.0.1:30000 --shared-prefix 4096 --shared-prefix-repeats 3 \
  --ready-timeout 90 --timeout 60 --out $OUT/prefix.json > $OUT/prefix.log 2>&1
echo "prefix rc=$?"; python3 -c "
import json; r=json.load(open('$OUT/prefix.json'))
print('prefix: cold TTFT p50 %.1f ms, warm %.1f ms, speedup p50 %.2fx, failed %d' % (r['cold_ttft_ms_p50'], r['warm_ttft_ms_p50'], r['speedup_p50'], r['failed']))"
sed 's/\x1b\[[0-9;]*m//g' $OUT/server.log | grep -m3 -E "structured output|prefix cache|KV cache pool"
kill -TERM $PID; sleep 2; kill -9 $PID 2>/dev/null; wait $PID 2>/dev/null
