#!/usr/bin/env bash
# s16-interf (issue 17): the 32K-prompt interference run with the cost-sized prefill pieces
# (default --mixed-step-budget 2) against the old fixed pieces (--mixed-step-budget 0, and the
# CUDA pool's default release of freed memory: main's behaviour), then the new sizing with the
# driver's release (what the pool setting alone does), each with the server's step log.
set -u
D=.gpu-s16-interf
mkdir -p /tmp/b && tar -xJf $D/bundle.tar.xz -C /tmp/b && . /tmp/b/env.sh
T0=$(date +%s); el() { echo $(( $(date +%s) - T0 )); }
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
timeout 100 python3 $D/random_checkpoint.py --shape qwen3-8b --out /tmp/q8 > $OUT/checkpoint.log 2>&1
echo "checkpoint rc=$? at $(el) s"
export RUST_LOG="info,dflash_serve::steps=debug"
start() { /tmp/b/dflash-serve --model-path /tmp/q8 --port 30000 --speculative-algorithm NONE "$@" > /tmp/server-$NAME.log 2>&1 & PID=$!; }
stop() { kill -TERM $PID; sleep 1; kill -9 $PID 2>/dev/null; wait $PID 2>/dev/null; }
inter() {
  timeout $1 python3 $D/load.py http://127.0.0.1:30000 --interference 32768 --interference-streams 16 \
    --output-len 2048 --ready-timeout 60 --timeout 60 --out $OUT/interference-$NAME.json > /tmp/interference-$NAME.log 2>&1
  echo "interference $NAME rc=$? at $(el) s"
  python3 $D/analyze.py $NAME $OUT/interference-$NAME.json /tmp/server-$NAME.log 2>&1 | tee -a $OUT/summary.txt
}
NAME=budget2; start; inter 70; stop
NAME=old; DFLASH_CUDA_RELEASE_FREED=1 start --mixed-step-budget 0; inter 70; stop
if [ $(el) -lt 165 ]; then NAME=budget2-release; DFLASH_CUDA_RELEASE_FREED=1 start; inter $(( 225 - $(el) )); stop; fi
grep -h -iE "panick|error|warn" /tmp/server-*.log | sed 's/\x1b\[[0-9;]*m//g' | grep -v steps | head -5
tar -C /tmp -cJf $OUT/logs.tar.xz $(cd /tmp && ls server-*.log interference-*.log) 2>/dev/null
cp $OUT/checkpoint.log /dev/null
echo "done at $(el) s"
