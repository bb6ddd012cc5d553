#!/usr/bin/env bash
# e2e helper, run 1: per-phase breakdown of the chain round, A/B of pool threshold and chain select.
set -u
mkdir -p /tmp/e && tar -xJf .gpu/e2e/bundle.tar.xz -C /tmp/e && . /tmp/e/env.sh
S=/tmp/e/dflash-serve
B="--variants fast --e2e-only --budgets 16 --contexts 1024"
nvidia-smi --query-gpu=name,driver_version,memory.used --format=csv > $OUT/gpu.txt 2>&1
DFLASH_LEGACY_SELECT=1 timeout 40 $S bench $B --e2e-profile --no-e2e-check --pool-keep-mib 0 --e2e-tokens 1024 --out $OUT/base.json > $OUT/base.log 2>&1; echo "base rc=$?"
DFLASH_LEGACY_SELECT=1 timeout 35 $S bench $B --e2e-profile --no-e2e-check --e2e-tokens 1024 --out $OUT/pool.json > $OUT/pool.log 2>&1; echo "pool rc=$?"
timeout 45 $S bench $B --e2e-profile --e2e-tokens 1024 --out $OUT/new.json > $OUT/new.log 2>&1; echo "new rc=$?"
timeout 25 $S bench $B --no-e2e-check --e2e-tokens 2048 --out $OUT/new2048.json > $OUT/new2048.log 2>&1; echo "new2048 rc=$?"
tail -2 $OUT/*.log | cut -c1-300
