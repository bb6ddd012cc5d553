#!/usr/bin/env bash
# Issue 20, session 27 (bundle: dflash-serve + gpu_check with the one-row router-and-routing
# kernel and the DFLASH_STEP_ATTN_ONE switch):
#   1. gpu_check --moe: moe_router_route against gemv + moe_route bit for bit (moe_router_route
#      pass), the block checks, the 4-layer forward, the 48-layer Coder bench (decode graph);
#   2. the same with DFLASH_STEP_ATTN_ONE=1 (one-sequence decode attention on attn_step.cu);
#   3. Qwen3.6-35B-A3B, all 40 layers: decode and e2e with token checks;
#   4. Qwen3-8B (dense, fast variant): decode, e2e, kernel checks, step attention off then on;
#   5. ncu of the Coder cut to 4 layers with the step attention on.
set -u
D=${D:-.gpu-next}
mkdir -p /tmp/b && tar -xJf $D/bundle.tar.xz -C /tmp/b && . /tmp/b/env.sh
T0=$(date +%s); el() { echo $(( $(date +%s) - T0 )); }
mkdir -p $OUT/p
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee $OUT/p/gpu.txt; cat $D/BUILT
export DFLASH_TESTS_DIR=$PWD/tests
coder() {  # name, env
  env $2 timeout 150 /tmp/b/gpu_check cuda $OUT/p/coder-$1.json --moe > $OUT/p/coder-$1.log 2>&1
  echo "coder $1 rc=$? at $(el) s"
  python3 -c "
import json,sys; d=json.load(open(sys.argv[1]))
r=d.get('moe_router_route', {}); print('router_route', r.get('pass'), {k: v for k, v in r.items() if k.startswith(('ms_', 'experts'))}, [ (k, v.get('rows_differing'), v.get('wrong_renorm_rows_differing')) for k, v in r.items() if isinstance(v, dict)])
b=d['qwen3_coder_30b_a3b_shape_bench']; print({k: b[k] for k in ('decode_1', 'verify_chain_16', 'chain16_over_decode', 'prefill_1k_ms') if k in b})
print('block pass', d['moe_block'].get('pass'), 'hybrid pass', d['moe_hybrid_block'].get('pass'))
f=d.get('moe_target_fused_vs_plain_4_layers', {}); print('forward', json.dumps(f)[:700])
" $OUT/p/coder-$1.json 2>&1 | cut -c1-2500
}
coder base ""
coder step1 "DFLASH_STEP_ATTN_ONE=1"
timeout 120 /tmp/b/dflash-serve bench --model qwen3.6-35b-a3b --prefill 1024 --e2e-prompt 1024 \
  --e2e-tokens 64 --budgets 16 --e2e-profile --out $OUT/p/h35.json > $OUT/p/h35.log 2>&1
echo "35b-a3b rc=$? at $(el) s"; grep -m2 -i "error\|panic" $OUT/p/h35.log | cut -c1-300
python3 -c "
import json,sys; d=json.load(open(sys.argv[1]))
print({k: d[k] for k in d if k.startswith(('decode_', 'verify', 'e2e_step')) and not k.endswith('phases')})
e=d['e2e']; print('e2e', {k: (e[k].get('speedup_vs_plain'), e[k].get('warm_speedup_vs_plain')) for k in ('chain', 'ddtree_16') if k in e})
print('phases ms/round', {k: {p: round(v['ms_per_round'],3) for p, v in e[k]['engine'].items()} for k in ('plain', 'chain') if isinstance(e.get(k), dict) and 'engine' in e[k]})
" $OUT/p/h35.json 2>&1 | cut -c1-2500
for s in 0 1; do
  DFLASH_STEP_ATTN_ONE=$s timeout 90 /tmp/b/dflash-serve bench --model qwen3-8b --variants fast --contexts 1024 --batch-sizes \
    --sizes 1,16 --budgets 16 --e2e-tokens 64 --out $OUT/p/q8-step$s.json > $OUT/p/q8-step$s.log 2>&1
  echo "qwen3-8b step_attn_one=$s rc=$? at $(el) s"
  python3 -c "import json,sys; d=json.load(open(sys.argv[1])); f=d['variants']['fast']; print('decode', json.dumps(f.get('decode'))[:500]); print('e2e', json.dumps(f.get('e2e'))[:600]); print('checks', json.dumps(d.get('kernel_checks'))[:500])" $OUT/p/q8-step$s.json 2>&1 | cut -c1-1800
done
OURS='regex:^(moe_|gemv_|row_sumsq|rms_apply|gdn_|gattn_|argmax|topk|attn_|splitk_|kv_norm|qk_norm|add_rmsnorm|silu_mul)'
LEFT=$(( ${LIMIT:-560} - $(el) ))
if [ $LEFT -gt 60 ]; then
  DFLASH_STEP_ATTN_ONE=1 timeout $LEFT ncu --clock-control none --metrics gpu__time_duration.sum --csv --kernel-name "$OURS" \
    /tmp/b/gpu_check cuda /tmp/coder4.json --moe --moe-layers=4 > /tmp/coder.csv 2>$OUT/p/coder-ncu.err
  echo "coder ncu rc=$? at $(el) s"
  python3 deploy/bench/next/ncu_mean.py /tmp/coder.csv > $OUT/p/coder_kernels.txt; head -24 $OUT/p/coder_kernels.txt
  xz -9 -c /tmp/coder.csv > $OUT/p/coder_ncu.csv.xz
fi
tar -C $OUT -cJf $OUT/p.tar.xz p && rm -rf $OUT/p
echo "done at $(el) s"
