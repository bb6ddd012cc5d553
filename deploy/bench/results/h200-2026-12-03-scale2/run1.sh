#!/usr/bin/env bash
# Device call 1 (issue 17, tasks A and B): gpu_check --scale: prefill pieces over 8K-32K
# contexts (one-pass vs split-K, 4 and 8 warps, split counts; equality with the one-pass
# kernel), the 17..64-row skinny GEMMs against cuBLAS (errors, timings), batched decode
# steps at b16/32/64 (cuBLAS vs skinny, CUDA graphs) and mixed steps (16 decoders + a piece).
set -u
mkdir -p /tmp/b && tar -xJf .gpu/bundle.tar.xz -C /tmp/b && . /tmp/b/env.sh
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader
cd /tmp/b && timeout 200 ./gpu_check cuda $OUT/scale.json --scale > $OUT/scale.log 2>&1
echo "gpu_check rc=$?"
grep -E "^scale" $OUT/scale.log | grep -v "row_independent\|:repeat" | cut -c1-160
echo "== nonzero repeat / row_independent:"
grep -E "row_independent|:repeat" $OUT/scale.log | grep -v "err 0.000e0\|rel err 0.000e0" | head
grep -iE "error|panick" $OUT/scale.log | head -5
