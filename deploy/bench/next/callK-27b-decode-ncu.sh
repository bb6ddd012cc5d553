#!/usr/bin/env bash
# Issue 20 (bundle: dflash-serve + gpu_check): where the Qwen3.6-27B shape's decode step (17.07 ms
# on the H200 = 0.706 of the roofline; 0.75 is the goal) spends its time, per kernel, under ncu
# (our kernels only, after the random-weight init: --kernel-name): the sum of one step's kernel
# times against the step's wall time says how much is launch gaps (PDL's target) and how much
# is kernels off their bytes. PDL on (DFLASH_PDL) if PDL=1.
set -u
D=${D:-.gpu-serve}
mkdir -p /tmp/b && tar -xJf $D/bundle.tar.xz -C /tmp/b && . /tmp/b/env.sh
T0=$(date +%s); el() { echo $(( $(date +%s) - T0 )); }
mkdir -p $OUT/k
OURS='regex:^(moe_|gemv_|row_sumsq|rms_apply|gdn_|gattn_|argmax|topk|attn_|splitk_|kv_norm|qk_norm|add_rmsnorm|silu_mul)'
DFLASH_PDL=${PDL:-0} timeout ${LIMIT:-240} ncu --clock-control none --metrics gpu__time_duration.sum --csv --kernel-name "$OURS" \
  -c ${COUNT:-2600} /tmp/b/dflash-serve bench --model qwen3.6-27b --e2e-only --prefill 64 --e2e-prompt 64 \
  --e2e-tokens 8 --budgets 16 --no-e2e-check > /tmp/h27.csv 2>$OUT/k/h27.err
echo "h27 ncu rc=$? at $(el) s"; tail -2 $OUT/k/h27.err | cut -c1-300
python3 deploy/bench/next/ncu_mean.py /tmp/h27.csv > $OUT/k/h27_kernels.txt; head -45 $OUT/k/h27_kernels.txt
xz -9 -c /tmp/h27.csv > $OUT/k/h27_ncu.csv.xz
echo "done at $(el) s"
