#!/usr/bin/env bash
# Session 8, device call 3: issue 16's "bench figures unchanged" as a same-call A/B: the
# pre-layout binary (aa17e1b, before 6f182f7) and the post-layout one (a3c4eb5), the same bench.
set -u
mkdir -p /tmp/b && tar -xJf .gpu/bundle.tar.xz -C /tmp/b && . /tmp/b/env.sh
nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used --format=csv > $OUT/gpu.txt 2>&1
timeout 270 /tmp/b/dflash-serve-old bench --e2e-tokens 512 --variants fast --out $OUT/bench-old.json > $OUT/bench-old.log 2>&1
echo "old rc=$?"
timeout 270 /tmp/b/dflash-serve-new bench --e2e-tokens 512 --variants fast --out $OUT/bench-new.json > $OUT/bench-new.log 2>&1
echo "new rc=$?"
