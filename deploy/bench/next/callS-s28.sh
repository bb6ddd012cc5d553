#!/usr/bin/env bash
# Issues 20 / 17, session 28 (bundle: dflash-serve + gpu_check at 65d4e07 plus: the one-row
# GEMV's first weight spans issued before its input norm and before its PDL wait (NORM_SELF);
# every PDL kernel's trigger after its own wait, the heavy ones' after their weight / key
# streams; the one-sequence step attention's loads before its wait, its merge 16 loads deep):
#   1. DFLASH_GATTN_SPLIT2=1 gpu_check --hybrid (gattn_split2's fused_attention_layer_vs_plain
#      f32 1e-4 / bf16 2e-2 and the wrong case; per-call us by keys per split against call O's
#      first form: t1 54.2 us, t16 127.3 us; 27B decode against s27's 20.73 ms);
#   2. gpu_check --moe (Coder decode graph against s27's 3.85-3.87 ms, router_route bit for bit),
#      with DFLASH_PDL=1, with DFLASH_STEP_ONE_BLOCKS=64 / 32 (16 / 8 splits a KV head, not 33);
#   2b. Qwen3-8B (fast variant) decode against s27's 5.87 ms, PDL off / on, fused_attention checks;
#   3. Qwen3.6-35B-A3B decode and e2e: gattn first / second form, PDL on; 27B second form, PDL
#      off / on;
#   4. ncu of the Coder cut to 4 layers (per-kernel us against s27's coder_kernels.txt).
set -u
D=${D:-.gpu-s28}
mkdir -p /tmp/b && tar -xJf $D/bundle.tar.xz -C /tmp/b && . /tmp/b/env.sh
T0=$(date +%s); el() { echo $(( $(date +%s) - T0 )); }
mkdir -p $OUT/s
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee $OUT/s/gpu.txt; cat $D/BUILT
export DFLASH_TESTS_DIR=$PWD/tests
( cd /tmp/b && DFLASH_GATTN_SPLIT2=1 timeout 150 ./gpu_check cuda $OUT/s/hybrid.json --hybrid > $OUT/s/hybrid.log 2>&1; echo "hybrid rc=$? at $(el) s" )
python3 - $OUT/s/hybrid.json <<'PY' 2>&1 | cut -c1-3000
import json, sys
d = json.load(open(sys.argv[1]))["qwen3_6_27b_shape_bf16"]
a = d.get("fused_attention_layer_vs_plain", {})
for k, v in a.items():
    print(k, {x: v.get(x) for x in ("out_rel_err", "pass", "wrong_case_rejected", "fused_us_per_call")}, v.get("fused_us_per_call_by_split"))
g = d.get("decode_graph_vs_eager", {}); print("graph", {x: g.get(x) for x in ("bit_exact", "steps_not_bit_equal", "after_rollback_steps_not_bit_equal", "decode_graph_ms", "graph_fraction_of_roofline")})
print("decode", d.get("decode_1", {}).get("ms"), d.get("decode_1", {}).get("fraction_of_roofline"), "chain16", d.get("verify_chain_16", {}).get("ms"), "tree64", d.get("verify_tree_64_ddtree_like_depth16", {}).get("ms"))
PY
coder() {  # name, env
  env $2 timeout 120 /tmp/b/gpu_check cuda $OUT/s/coder-$1.json --moe > $OUT/s/coder-$1.log 2>&1
  echo "coder $1 rc=$? at $(el) s"
  python3 -c "
import json,sys; d=json.load(open(sys.argv[1]))
r=d.get('moe_router_route', {}); print('router_route', r.get('pass'), [(k, v.get('rows_differing'), v.get('wrong_renorm_rows_differing')) for k, v in r.items() if isinstance(v, dict)])
b=d['qwen3_coder_30b_a3b_shape_bench']; print({k: b[k] for k in b if not isinstance(b[k], list)})
print('block pass', d['moe_block'].get('pass'), 'hybrid pass', d['moe_hybrid_block'].get('pass'))
f=d.get('moe_target_fused_vs_plain_4_layers', {}); print('forward', json.dumps(f)[:600])
" $OUT/s/coder-$1.json 2>&1 | cut -c1-2000
}
coder base ""
coder pdl1 "DFLASH_PDL=1"
coder ob64 "DFLASH_STEP_ONE_BLOCKS=64"
coder ob32 "DFLASH_STEP_ONE_BLOCKS=32"
for v in 0 1; do
  DFLASH_PDL=$v timeout 90 /tmp/b/dflash-serve bench --model qwen3-8b --variants fast --contexts 1024 --batch-sizes \
    --sizes 1,16 --budgets 16 --e2e-tokens 64 --out $OUT/s/q8-pdl$v.json > $OUT/s/q8-pdl$v.log 2>&1
  echo "qwen3-8b pdl=$v rc=$? at $(el) s"
  python3 -c "import json,sys; d=json.load(open(sys.argv[1])); f=d['variants']['fast']; print('decode', json.dumps(f.get('decode'))[:500]); print('e2e', json.dumps(f.get('e2e'))[:600]); print('checks', json.dumps(d.get('kernel_checks'))[:700])" $OUT/s/q8-pdl$v.json 2>&1 | cut -c1-2000
done
bench() {  # model, split2, pdl
  DFLASH_GATTN_SPLIT2=$2 DFLASH_PDL=${3:-0} timeout 120 /tmp/b/dflash-serve bench --model $1 --prefill 1024 --e2e-prompt 1024 \
    --e2e-tokens 64 --budgets 16 --out $OUT/s/$1-v$2-p${3:-0}.json > $OUT/s/$1-v$2-p${3:-0}.log 2>&1
  echo "$1 split2=$2 pdl=${3:-0} rc=$? at $(el) s"; grep -m2 -i "error\|panic" $OUT/s/$1-v$2-p${3:-0}.log | cut -c1-300
  python3 -c "
import json,sys; d=json.load(open(sys.argv[1]))
print({k: d[k] for k in d if k.startswith(('decode_', 'verify', 'e2e_step')) and not k.endswith('phases')})
e=d['e2e']; print('e2e', {k: (e[k].get('speedup_vs_plain'), e[k].get('warm_speedup_vs_plain')) for k in ('chain', 'ddtree_16') if k in e})
" $OUT/s/$1-v$2-p${3:-0}.json 2>&1 | cut -c1-1500
}
bench qwen3.6-35b-a3b 0
bench qwen3.6-35b-a3b 1
bench qwen3.6-35b-a3b 0 1
[ $(( ${LIMIT:-480} - $(el) )) -gt 50 ] && bench qwen3.6-27b 1
[ $(( ${LIMIT:-480} - $(el) )) -gt 50 ] && bench qwen3.6-27b 1 1
OURS='regex:^(moe_|gemv_|row_sumsq|rms_apply|gdn_|gattn_|argmax|topk|attn_|splitk_|kv_norm|qk_norm|add_rmsnorm|silu_mul)'
LEFT=$(( ${LIMIT:-480} - $(el) ))
if [ $LEFT -gt 60 ]; then
  timeout 60 ncu --clock-control none --metrics gpu__time_duration.sum --csv --kernel-name "$OURS" \
    /tmp/b/gpu_check cuda /tmp/coder4.json --moe --moe-layers=4 > /tmp/coder.csv 2>$OUT/s/coder-ncu.err
  echo "coder ncu rc=$? at $(el) s"
  python3 deploy/bench/next/ncu_mean.py /tmp/coder.csv > $OUT/s/coder_kernels.txt; head -24 $OUT/s/coder_kernels.txt
  xz -9 -c /tmp/coder.csv > $OUT/s/coder_ncu.csv.xz
fi
tar -C $OUT -cJf $OUT/s.tar.xz s && rm -rf $OUT/s
echo "done at $(el) s"
