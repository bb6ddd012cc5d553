#!/usr/bin/env bash
# Session 18, device call B1 (issue 20): gpu_check --moe (the decode-warps MoE kernels of cbd52fa,
# first run), the Qwen3.6-27B family bench and HF transformers on the same shape.
set -u
D=.gpu-s18b
mkdir -p /tmp/b && tar -xJf $D/bundle.tar.xz -C /tmp/b && . /tmp/b/env.sh
T0=$(date +%s); el() { echo $(( $(date +%s) - T0 )); }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee $OUT/gpu.txt
( cd /tmp/b && timeout 90 ./gpu_check cuda $OUT/moe.json --moe > $OUT/moe.log 2>&1; echo "gpu_check --moe rc=$? at $(el) s" )
grep -iE "moe|error|panick|fail" $OUT/moe.log | tail -20 | cut -c1-220
timeout 240 /tmp/b/dflash-serve bench --model qwen3.6-27b --prefill 4096 --e2e-prompt 1024 --e2e-tokens 192 \
  --budgets 16,64 --out $OUT/h27.json > $OUT/h27.log 2>&1
echo "bench 27b rc=$? at $(el) s"; tail -n 25 $OUT/h27.log | cut -c1-240
timeout $(( 570 - $(el) )) python3 deploy/bench/hf_baseline.py --model qwen3.6-27b --out $OUT/hf27.json > $OUT/hf27.log 2>&1
echo "hf 27b rc=$? at $(el) s"; tail -c 1500 $OUT/hf27.log
