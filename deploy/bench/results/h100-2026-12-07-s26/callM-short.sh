#!/usr/bin/env bash
# Session 26's second call (on the machine call L left warm, bundle .gpu-next at 4f6b8ae): the full
# Qwen3-Coder-30B-A3B (gpu_check --moe, 48 layers) and the full Qwen3.6-35B-A3B (40 layers), defaults.
mkdir -p /tmp/b && tar -xJf .gpu-next/bundle.tar.xz -C /tmp/b && . /tmp/b/env.sh; mkdir -p $OUT/m; T0=$(date +%s)
timeout 130 /tmp/b/gpu_check cuda $OUT/m/coder.json --moe > $OUT/m/coder.log 2>&1; echo "coder rc=$? at $(( $(date +%s) - T0 )) s"
timeout 150 /tmp/b/dflash-serve bench --model qwen3.6-35b-a3b --prefill 1024 --e2e-prompt 1024 --e2e-tokens 64 --budgets 16 --out $OUT/m/h35.json > $OUT/m/h35.log 2>&1
tar -C $OUT -cJf $OUT/m.tar.xz m && rm -rf $OUT/m
