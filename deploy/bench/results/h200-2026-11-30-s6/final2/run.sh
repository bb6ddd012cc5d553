#!/usr/bin/env bash
# GPU run 9 (session 6, final main): the full issue-7 bench (fused path, end to end included) and the HF
# transformers baseline, in one call.
set -u
mkdir -p /tmp/b && tar -xJf .gpu/lead/bundle2.tar.xz -C /tmp/b && . /tmp/b/env.sh
nvidia-smi --query-gpu=name,driver_version,memory.used --format=csv > $OUT/gpu.txt 2>&1
timeout 240 /tmp/b/dflash-serve bench --e2e-tokens 512 --variants fast --out $OUT/bench.json > $OUT/bench.log 2>&1
echo "bench rc=$?"
timeout 70 python3 deploy/bench/hf_baseline.py --out $OUT/hf.json > $OUT/hf.log 2>&1
echo "hf rc=$?"
tail -3 $OUT/hf.log
timeout 150 /tmp/b/dflash-serve bench --variants fast --e2e-only --budgets 16,64 --e2e-profile --no-e2e-check --e2e-tokens 512 --out $OUT/profile.json > $OUT/profile.log 2>&1
echo "profile rc=$?"
