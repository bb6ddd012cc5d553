#!/usr/bin/env bash
# Session 10, device call 3: the 32K-prompt interference run (16 streams decoding, plain) at
# --prefill-tokens-while-decoding 256 (the default), 128 and 64: the streams' ITL during the
# long prefill against steady, and what the smaller pieces cost the long prompt (its prefill
# time).
set -u
mkdir -p /tmp/b && tar -xJf .gpu/bundle.tar.xz -C /tmp/b && . /tmp/b/env.sh
t0=$(date +%s)
timeout 150 python3 deploy/bench/random_checkpoint.py --shape qwen3-8b --out /tmp/q8 > $OUT/checkpoint.log 2>&1
echo "checkpoint rc=$? in $(( $(date +%s) - t0 )) s"
for piece in 256 128 64; do
  /tmp/b/dflash-serve --model-path /tmp/q8 --port 30000 --speculative-algorithm NONE \
    --prefill-tokens-while-decoding $piece > $OUT/server-$piece.log 2>&1 &
  PID=$!
  timeout 140 python3 deploy/bench/load.py http://127.0.0.1:30000 --interference 32768 --interference-streams 16 \
    --output-len 2048 --ready-timeout 90 --timeout 130 --out $OUT/interference-$piece.json > $OUT/interference-$piece.log 2>&1
  echo "piece $piece rc=$?"; python3 -c "
import json; r=json.load(open('$OUT/interference-$piece.json'))
print('piece $piece: steady ITL p50 %.2f ms; during prefill p50 %.2f p90 %.2f p99 %.2f max %.2f ms; max/steady %.2fx; long prefill %.0f ms (status %s)' % (
 r['steady_itl_ms']['p50'], r['itl_during_prefill_ms']['p50'], r['itl_during_prefill_ms']['p90'], r['itl_during_prefill_ms']['p99'], r['itl_during_prefill_ms']['max'], r['max_during_over_steady_p50'], r['long_prefill_ms'], r['long_status']))"
  kill -TERM $PID; sleep 2; kill -9 $PID 2>/dev/null; wait $PID 2>/dev/null
done
