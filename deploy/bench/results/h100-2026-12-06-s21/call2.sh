#!/usr/bin/env bash
# Issue 20: the 27B DDTree rounds after the verify-padding fix (profile of later requests), the
# 35B-A3B bench, and gpu_check --moe.
set -u
D=${D:-.gpu-serve}
mkdir -p /tmp/b && tar -xJf $D/bundle.tar.xz -C /tmp/b && . /tmp/b/env.sh
T0=$(date +%s); el() { echo $(( $(date +%s) - T0 )); }
mkdir -p $OUT/h
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee $OUT/h/gpu.txt
export RUST_LOG=warn DFLASH_TESTS_DIR=$PWD/tests
timeout 220 /tmp/b/dflash-serve bench --model qwen3.6-27b --e2e-only --e2e-prompt 1024 --e2e-tokens 128 \
  --budgets 16,64 --e2e-profile --out $OUT/h/h27p.json > $OUT/h/h27p.log 2>&1
echo "bench 27b rc=$? at $(el) s"; grep -iE "warn|declin" $OUT/h/h27p.log | head -5 | cut -c1-300
timeout 200 /tmp/b/dflash-serve bench --model qwen3.6-35b-a3b --e2e-prompt 1024 --e2e-tokens 128 \
  --budgets 16,64 --out $OUT/h/h35.json > $OUT/h/h35.log 2>&1
echo "bench 35b-a3b rc=$? at $(el) s"
left=$(( 580 - $(el) )); if [ $left -gt 60 ]; then
  ( cd /tmp/b && timeout $left ./gpu_check cuda $OUT/h/moe.json --moe > $OUT/h/moe.log 2>&1; echo "gpu_check --moe rc=$? at $(el) s" )
  grep -E "moe_hybrid_block|pass" $OUT/h/moe.log | head -8 | cut -c1-400
fi
tar -C $OUT -cJf $OUT/hybrids.tar.xz h && rm -rf $OUT/h
echo "done at $(el) s"
