#!/usr/bin/env bash
# Issue 20, session 27 (bundle: dflash-serve + gpu_check at the routing tail in registers and
# the DFLASH_STEP_ONE_BLOCKS knob). On an H200, first every Done-when figure (callO-issue20.sh
# with LIMIT=300); then:
#   1. gpu_check --moe (defaults: router_route, step attention for one sequence);
#   2. Qwen3-8B bench: one-sequence step attention at 0 (one block per SM), 32, 64, 256 blocks
#      (attention_us_t1_* and decode);
#   3. Qwen3.6-35B-A3B decode and e2e;  4. ncu of the Coder cut to 4 layers.
set -u
D=${D:-.gpu-next}
mkdir -p /tmp/b && tar -xJf $D/bundle.tar.xz -C /tmp/b && . /tmp/b/env.sh
T0=$(date +%s); el() { echo $(( $(date +%s) - T0 )); }
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1); echo "$GPU"; cat $D/BUILT
if echo "$GPU" | grep -q H200; then
  OUT=$OUT LIMIT=300 bash deploy/bench/next/callO-issue20.sh 2>&1 | tail -60
fi
T0=$(date +%s)
mkdir -p $OUT/q; echo "$GPU" > $OUT/q/gpu.txt
export DFLASH_TESTS_DIR=$PWD/tests
timeout 150 /tmp/b/gpu_check cuda $OUT/q/coder.json --moe > $OUT/q/coder.log 2>&1
echo "coder rc=$? at $(el) s"
python3 -c "
import json,sys; d=json.load(open(sys.argv[1]))
r=d.get('moe_router_route', {}); print('router_route', r.get('pass'), {k: v for k, v in r.items() if k.startswith(('ms_', 'experts'))})
b=d['qwen3_coder_30b_a3b_shape_bench']; print({k: b[k] for k in ('decode_1', 'verify_chain_16', 'chain16_over_decode') if k in b})
print('block pass', d['moe_block'].get('pass'), 'hybrid pass', d['moe_hybrid_block'].get('pass'))
f=d.get('moe_target_fused_vs_plain_4_layers', {}); print('forward decode', json.dumps(f.get('decode_1'))[:400])
" $OUT/q/coder.json 2>&1 | cut -c1-2000
for blk in 0 32 64 256; do
  DFLASH_STEP_ONE_BLOCKS=$blk timeout 60 /tmp/b/dflash-serve bench --model qwen3-8b --variants fast --contexts 1024,8192 --batch-sizes \
    --sizes 1 --budgets 16 --e2e-tokens 32 --no-e2e-check --out $OUT/q/q8-b$blk.json > $OUT/q/q8-b$blk.log 2>&1
  echo "qwen3-8b step blocks=$blk rc=$? at $(el) s"
  python3 -c "import json,sys; d=json.load(open(sys.argv[1])); f=d['variants']['fast']; print('decode', {k: round(v['ms'],3) for k, v in f.get('decode', {}).items()}); print({k: v for k, v in d.get('kernel_checks', {}).items() if k.startswith('attention_us_t1')}); print({k: v for k, v in d.get('kernel_checks', {}).items() if k.startswith('fused_attention:t1_ctx') and 'device_split' in k and k.endswith('vs_plain')})" $OUT/q/q8-b$blk.json 2>&1 | cut -c1-1500
done
timeout 120 /tmp/b/dflash-serve bench --model qwen3.6-35b-a3b --prefill 1024 --e2e-prompt 1024 \
  --e2e-tokens 64 --budgets 16 --out $OUT/q/h35.json > $OUT/q/h35.log 2>&1
echo "35b-a3b rc=$? at $(el) s"; grep -m2 -i "error\|panic" $OUT/q/h35.log | cut -c1-300
python3 -c "
import json,sys; d=json.load(open(sys.argv[1]))
print({k: d[k] for k in d if k.startswith(('decode_', 'e2e_step')) and not k.endswith('phases')})
e=d['e2e']; print('e2e', {k: (e[k].get('speedup_vs_plain'), e[k].get('warm_speedup_vs_plain')) for k in ('chain', 'ddtree_16') if k in e})
" $OUT/q/h35.json 2>&1 | cut -c1-1500
OURS='regex:^(moe_|gemv_|row_sumsq|rms_apply|gdn_|gattn_|argmax|topk|attn_|splitk_|kv_norm|qk_norm|add_rmsnorm|silu_mul)'
LEFT=$(( ${LIMIT:-540} - $(el) ))
if [ $LEFT -gt 60 ]; then
  timeout $LEFT ncu --clock-control none --metrics gpu__time_duration.sum --csv --kernel-name "$OURS" \
    /tmp/b/gpu_check cuda /tmp/coder4.json --moe --moe-layers=4 > /tmp/coder.csv 2>$OUT/q/coder-ncu.err
  echo "coder ncu rc=$? at $(el) s"
  python3 deploy/bench/next/ncu_mean.py /tmp/coder.csv > $OUT/q/coder_kernels.txt; head -16 $OUT/q/coder_kernels.txt
  xz -9 -c /tmp/coder.csv > $OUT/q/coder_ncu.csv.xz
fi
# Why gattn_split takes ~30 us for a decode step's 16 keys a warp: ncu's full set on two of its
# launches (the 35B-A3B cut to 12 layers, 1K prompt).
LEFT=$(( ${LIMIT:-540} - $(el) ))
if [ $LEFT -gt 40 ]; then
  timeout $LEFT ncu --set full -k regex:gattn_split_bf16 -s 6 -c 2 --csv --page details \
    /tmp/b/dflash-serve bench --model deploy/bench/next/qwen3.6-35b-a3b-12-layers.json --e2e-only \
    --prefill 1024 --e2e-prompt 1024 --e2e-tokens 8 --budgets 16 --no-e2e-check > $OUT/q/gattn_full.csv 2>$OUT/q/gattn-ncu.err
  echo "gattn ncu rc=$? at $(el) s"
  grep -E "Duration|Registers|Achieved Occupancy|Theoretical Occupancy|Grid Size|Block Size|Warp Cycles Per Issued|Issue Slots Busy|Stall|Memory Throughput|DRAM Throughput|Eligible|Active Warps" $OUT/q/gattn_full.csv | cut -d, -f5,12-16 | head -40
fi
tar -C $OUT -cJf $OUT/q.tar.xz q && rm -rf $OUT/q
echo "done at $(el) s"
