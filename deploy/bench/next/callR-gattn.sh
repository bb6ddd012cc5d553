#!/usr/bin/env bash
# Issue 20, session 27 (bundle: dflash-serve + gpu_check with gattn_split2, DFLASH_GATTN_SPLIT2:
# lanes over keys for the scores, lanes over dims for the outputs, q staged in shared memory):
#   1. DFLASH_GATTN_SPLIT2=1 gpu_check --hybrid: fused_attention_layer_vs_plain (f32 1e-4 / bf16
#      2e-2, the wrong case rejected; per-call us by keys per split: call O has the first
#      form's), decode / chain-16 / tree figures, graph vs eager bit for bit;
#   2. Qwen3.6-35B-A3B decode and e2e, the first form then the second;
#   3. Qwen3.6-27B decode and e2e through the engine, the second form then the first.
set -u
D=${D:-.gpu-next}
mkdir -p /tmp/b && tar -xJf $D/bundle.tar.xz -C /tmp/b && . /tmp/b/env.sh
T0=$(date +%s); el() { echo $(( $(date +%s) - T0 )); }
mkdir -p $OUT/r
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/r/gpu.txt; cat $D/BUILT
export DFLASH_TESTS_DIR=$PWD/tests
( cd /tmp/b && DFLASH_GATTN_SPLIT2=1 timeout 150 ./gpu_check cuda $OUT/r/hybrid.json --hybrid > $OUT/r/hybrid.log 2>&1; echo "hybrid rc=$? at $(el) s" )
python3 - $OUT/r/hybrid.json <<'PY' 2>&1 | cut -c1-3000
import json, sys
d = json.load(open(sys.argv[1]))["qwen3_6_27b_shape_bf16"]
a = d.get("fused_attention_layer_vs_plain", {})
for k, v in a.items():
    print(k, {x: v.get(x) for x in ("out_rel_err", "pass", "wrong_case_rejected", "fused_us_per_call")}, v.get("fused_us_per_call_by_split"))
g = d.get("decode_graph_vs_eager", {}); print("graph", {x: g.get(x) for x in ("bit_exact", "steps_not_bit_equal", "after_rollback_steps_not_bit_equal", "decode_graph_ms", "graph_fraction_of_roofline")})
print("decode", d.get("decode_1", {}).get("ms"), d.get("decode_1", {}).get("fraction_of_roofline"), "chain16", d.get("verify_chain_16", {}).get("ms"), "tree64", d.get("verify_tree_64_ddtree_like_depth16", {}).get("ms"))
PY
for v in 0 1; do
DFLASH_GATTN_SPLIT2=$v timeout 120 /tmp/b/dflash-serve bench --model qwen3.6-35b-a3b --prefill 1024 --e2e-prompt 1024 \
  --e2e-tokens 64 --budgets 16 --out $OUT/r/h35-v$v.json > $OUT/r/h35-v$v.log 2>&1
echo "35b-a3b split2=$v rc=$? at $(el) s"; grep -m2 -i "error\|panic" $OUT/r/h35-v$v.log | cut -c1-300
python3 -c "
import json,sys; d=json.load(open(sys.argv[1]))
print({k: d[k] for k in d if k.startswith(('decode_', 'verify', 'e2e_step')) and not k.endswith('phases')})
e=d['e2e']; print('e2e', {k: (e[k].get('speedup_vs_plain'), e[k].get('warm_speedup_vs_plain')) for k in ('chain', 'ddtree_16') if k in e})
" $OUT/r/h35-v$v.json 2>&1 | cut -c1-1500
done
for v in 1 0; do
  [ $(( ${LIMIT:-400} - $(el) )) -gt 60 ] || break
DFLASH_GATTN_SPLIT2=$v timeout 120 /tmp/b/dflash-serve bench --model qwen3.6-27b --prefill 1024 --e2e-prompt 1024 \
  --e2e-tokens 64 --budgets 16 --out $OUT/r/h27-v$v.json > $OUT/r/h27-v$v.log 2>&1
echo "27b split2=$v rc=$? at $(el) s"; grep -m2 -i "error\|panic" $OUT/r/h27-v$v.log | cut -c1-300
python3 -c "
import json,sys; d=json.load(open(sys.argv[1]))
print({k: d[k] for k in d if k.startswith(('decode_', 'e2e_step')) and not k.endswith('phases')})
e=d['e2e']; print('e2e', {k: (e[k].get('speedup_vs_plain'), e[k].get('warm_speedup_vs_plain')) for k in ('chain', 'ddtree_16') if k in e})
" $OUT/r/h27-v$v.json 2>&1 | cut -c1-1500
done
tar -C $OUT -cJf $OUT/r.tar.xz r && rm -rf $OUT/r
echo "done at $(el) s"
