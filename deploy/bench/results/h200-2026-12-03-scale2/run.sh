#!/usr/bin/env bash
# The one device call of this session (issue 17, tasks A and B), run from the session's
# checkout with the bundle and this script carried in .gpu-wtc/: gpu_check --scale (prefill
# pieces over 1K-32K contexts: one-pass vs split-K with 4- and 8-warp blocks, equality with
# the one-pass kernel; the 17..64-row skinny GEMMs against cuBLAS; batched decode steps b16/
# 32/64 cuBLAS vs skinny in CUDA graphs; mixed steps of 16 decoders + a piece), while a random
# Qwen3-8B checkpoint is written on the CPU; then the server (plain, default flags): the
# 32K-prompt interference run and load c=1,32; then the interference run again with
# --prefill-tokens-while-decoding 128 if time is left.
set -u
mkdir -p /tmp/b && tar -xJf .gpu-wtc/bundle.tar.xz -C /tmp/b && . /tmp/b/env.sh
T0=$(date +%s); el() { echo $(( $(date +%s) - T0 )); }
( CUDA_VISIBLE_DEVICES= OMP_NUM_THREADS=10 timeout 110 python3 deploy/bench/random_checkpoint.py --shape qwen3-8b --out /tmp/q8 > $OUT/checkpoint.log 2>&1; echo "checkpoint rc=$? at $(el) s" > /tmp/ck.rc ) &
CK=$!
( cd /tmp/b && timeout 85 ./gpu_check cuda $OUT/scale.json --scale > $OUT/scale.log 2>&1; echo "gpu_check rc=$? at $(el) s" )
grep -E "^scale" $OUT/scale.log | grep -vE "piece_attn|gemv_|attn t" | cut -c1-140
grep -E "^scale attn" $OUT/scale.log | grep -E "one_pass|sdefault|dispatch" | sed 's/scale attn //' | cut -c1-90
echo "== worst errors"; grep -E "^scale (piece_attn|gemv)" $OUT/scale.log | grep -v "row_indep\|repeat" | awk '{print $(NF-3), $0}' | sort -g | tail -3 | cut -c1-140
grep -E "^scale gemv" $OUT/scale.log | grep -v "row_indep" | awk '{print $NF, $2}' | sort -g | tail -3
echo "== nonzero repeat / row_independent:"; grep -E "row_independent|:repeat" $OUT/scale.log | grep -vE "err 0.000e0 |rel err 0.000e0" | head -4
wait $CK; cat /tmp/ck.rc
start() { /tmp/b/dflash-serve --model-path /tmp/q8 --port 30000 --speculative-algorithm NONE "$@" > $OUT/server-$NAME.log 2>&1 & PID=$!; }
stop() { kill -TERM $PID; sleep 1; kill -9 $PID 2>/dev/null; wait $PID 2>/dev/null; }
inter() {
  timeout $1 python3 deploy/bench/load.py http://127.0.0.1:30000 --interference 32768 --interference-streams 16 \
    --output-len 2048 --ready-timeout 60 --timeout 60 --out $OUT/interference-$NAME.json > $OUT/interference-$NAME.log 2>&1
  echo "interference $NAME rc=$? at $(el) s"; python3 -c "
import json; r=json.load(open('$OUT/interference-$NAME.json'))
d=r['itl_during_prefill_ms']; s=r['steady_itl_ms']['p50']
print('$NAME: steady ITL p50 %.2f ms; during prefill p50 %.2f p90 %.2f p99 %.2f max %.2f ms; p50/steady %.2fx, p99/steady %.2fx, max/steady %.2fx; long prefill %.0f ms (status %s)' % (
 s, d['p50'], d['p90'], d['p99'], d['max'], d['p50']/s, d['p99']/s, r['max_during_over_steady_p50'], r['long_prefill_ms'], r['long_status']))"
}
NAME=plain; start
inter 75
timeout 40 python3 deploy/bench/load.py http://127.0.0.1:30000 --concurrency 1,32 \
  --input-len 512 --output-len 256 --waves 1 --ready-timeout 20 --timeout 30 \
  --out $OUT/load-plain.json > $OUT/load-plain.log 2>&1
echo "load plain rc=$? at $(el) s"; tail -n 3 $OUT/load-plain.log | cut -c1-300
stop
grep -m2 -E "KV cache pool|max_total_num_tokens" $OUT/server-plain.log | sed 's/\x1b\[[0-9;]*m//g' | cut -c1-200
if [ $(el) -lt 175 ]; then NAME=piece128; start --prefill-tokens-while-decoding 128; inter $(( 232 - $(el) )); stop; fi
grep -h -iE "panick|error" $OUT/server-*.log | sed 's/\x1b\[[0-9;]*m//g' | head -4
echo "done at $(el) s"
