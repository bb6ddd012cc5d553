#!/usr/bin/env bash
# Issue 20 (bundle: dflash-serve + gpu_check): where a sparse-MoE decode step's time goes, per
# kernel, under ncu (GPU time of each launch; graph replays are profiled per node):
#   1. `gpu_check --moe --moe-layers=4`: the device MoE block checks (1/16/64/100 rows) and the
#      Qwen3-Coder-30B-A3B shape cut to 4 layers (decode graph / eager / plain, chain-16);
#   2. the 12-layer Qwen3.6-35B-A3B config through the family bench (short prompts), our
#      kernels only (candle's and cuBLAS's are left out by the name filter), with the shared
#      expert inside the one-row block and the decode step graphs on.
# The per-kernel means (ncu_mean.py) say which launch of the 1-row block is off its bytes.
set -u
D=${D:-.gpu-serve}
mkdir -p /tmp/b && tar -xJf $D/bundle.tar.xz -C /tmp/b && . /tmp/b/env.sh
T0=$(date +%s); el() { echo $(( $(date +%s) - T0 )); }
mkdir -p $OUT/f
OURS='regex:^(moe_|gemv_|row_sumsq|rms_apply|gdn_|gattn_|argmax|topk|attn_|splitk_|kv_norm|qk_norm|add_rmsnorm|silu_mul)'
timeout 200 ncu --clock-control none --metrics gpu__time_duration.sum --csv --kernel-name "$OURS" \
  /tmp/b/gpu_check cuda $OUT/f/moe.json --moe --moe-layers=4 > /tmp/coder.csv 2>$OUT/f/coder.err
echo "coder ncu rc=$? at $(el) s"; tail -2 $OUT/f/coder.err | cut -c1-300
python3 deploy/bench/next/ncu_mean.py /tmp/coder.csv > $OUT/f/coder_kernels.txt; head -45 $OUT/f/coder_kernels.txt
DFLASH_MOE_SHARED_IN_BLOCK=1 DFLASH_HYBRID_DECODE_GRAPHS=1 timeout $(( ${LIMIT:-560} - $(el) )) ncu --clock-control none --metrics gpu__time_duration.sum --csv --kernel-name "$OURS" \
  /tmp/b/dflash-serve bench --model deploy/bench/next/qwen3.6-35b-a3b-12-layers.json --e2e-only \
  --prefill 64 --e2e-prompt 64 --e2e-tokens 24 --budgets 16 --no-e2e-check > /tmp/h35.csv 2>$OUT/f/h35.err
echo "h35 ncu rc=$? at $(el) s"; tail -2 $OUT/f/h35.err | cut -c1-300
python3 deploy/bench/next/ncu_mean.py /tmp/h35.csv > $OUT/f/h35_kernels.txt; head -45 $OUT/f/h35_kernels.txt
xz -9 -c /tmp/coder.csv > $OUT/f/coder_ncu.csv.xz; xz -9 -c /tmp/h35.csv > $OUT/f/h35_ncu.csv.xz
echo "done at $(el) s"
