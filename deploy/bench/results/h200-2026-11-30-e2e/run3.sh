#!/usr/bin/env bash
# e2e helper, run 3 (final): main@54babad (base) against branch e2e-overhead at e3bd4e7 in one call.
set -u
mkdir -p /tmp/e && tar -xJf .gpu/e2e/bundle3.tar.xz -C /tmp/e && . /tmp/e/env.sh
nvidia-smi --query-gpu=name,driver_version,memory.used --format=csv > $OUT/gpu.txt 2>&1
timeout 45 /tmp/e/dflash-serve-base bench --variants fast --contexts 1024 --sizes 16 --prefill 1024 --reps 3 --decode-steps 8 --budgets 16,64 --e2e-tokens 512 --out $OUT/base512.json > $OUT/base512.log 2>&1; echo "base512 rc=$?"
N="/tmp/e/dflash-serve bench --variants fast --e2e-only --contexts 1024"
timeout 28 $N --budgets 16,64 --e2e-tokens 512 --out $OUT/final512.json > $OUT/final512.log 2>&1; echo "final512 rc=$?"
timeout 40 $N --budgets 16 --e2e-profile --no-e2e-check --e2e-tokens 1024 --out $OUT/final1024.json > $OUT/final1024.log 2>&1; echo "final1024 rc=$?"
