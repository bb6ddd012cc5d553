#!/usr/bin/env bash
# Session 31 (issue 20): the hybrid verify and commit forms as now shipped (on by default since
# call L1: cuBLASLt for the verify's larger unnormed products, the fused tree forward up to 32
# nodes, the batched GDN commit, the MoE row gather kernel) against all of them off, on one
# machine:
#   1. gpu_check --hybrid: every hybrid check and figure (decode, chain-16, both 64-node trees
#      over decode on the defaults), `verify_lt` (chain-16, a 16-node tree and both 64-node
#      trees: skinny / lt / fused_tree, phases, logits and a decode after a committed path
#      against skinny; the batched commit bit for bit);
#   2. the 27B through the engine (TOKENS generated, default 256): defaults and all off (the
#      chunked GDN tree form, on by default since call L2, does not reach budget-16 trees);
#   3. the 35B-A3B through the engine (128 tokens) the same two ways, if time is left.
# Bundle: dflash-serve + gpu_check. ~330 s; LIMIT (default 480) caps the call.
set -u
LIMIT=${LIMIT:-480}; TOKENS=${TOKENS:-256}
D=${D:-.gpu-next}
mkdir -p /tmp/b && tar -xJf $D/bundle.tar.xz -C /tmp/b && . /tmp/b/env.sh
T0=$(date +%s); el() { echo $(( $(date +%s) - T0 )); }
mkdir -p $OUT/l2
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee $OUT/l2/gpu.txt; cat $D/BUILT
export DFLASH_TESTS_DIR=$PWD/tests
( cd /tmp/b && timeout 200 ./gpu_check cuda $OUT/l2/hybrid.json --hybrid > $OUT/l2/hybrid.log 2>&1; echo "hybrid rc=$? at $(el) s" )
python3 - $OUT/l2/hybrid.json <<'PY' 2>&1 | cut -c1-3500
import json, sys
d = json.load(open(sys.argv[1]))
h = d.get("qwen3_6_27b_shape_bf16", d)
for k in ("decode_1", "verify_chain_16", "verify_tree_64_binary_depth6", "verify_tree_64_ddtree_like_depth16"):
    print(k, {a: h.get(k, {}).get(a) for a in ("ms", "fraction_of_roofline", "over_decode")})
for k, v in h.get("verify_lt", {}).items():
    if not isinstance(v, dict):
        print(k, v); continue
    if k == "batched_settle": print(k, v); continue
    for w in ("skinny", "lt", "fused_tree", "tree_chunked"):
        if w in v:
            e = v[w]; c = e.get("vs_skinny") or {}; n = e.get("commit_path_then_decode_vs_skinny") or {}
            print(k, w, round(e["ms"], 3), round(e["over_decode"], 4), "rel", c.get("rel_err"), c.get("argmax_agree"), "next", n.get("rel_err"), n.get("argmax_agree"))
            print("   ", {p: round(q["ms"], 2) for p, q in e["profile"].items() if isinstance(q, dict)})
    if "error" in v: print(k, v["error"][:400])
for k, v in h.get("gdn_layer_paths", {}).items():
    if k.startswith("gdn_tree") and isinstance(v, dict):
        print("gdn", k, {a: v.get(a) for a in ("pass", "y_rel_err", "writes_rel_err", "deepest_path_state_rel_err", "wrong_tree_as_star_y_rel_err", "call_ms")})
for k, v in h.get("fused_attention_layer_vs_plain", {}).items():
    print("attn", k, {a: v.get(a) for a in ("pass", "out_rel_err", "wrong_case_rejected")})
PY
summary() {  # json
  python3 -c "
import json,sys; d=json.load(open(sys.argv[1]))
print({k: (round(v['ms_per_token'],3), round(v['fraction_of_roofline'],4)) for k, v in d.items() if k.startswith('decode_') and isinstance(v, dict) and 'ms_per_token' in v})
print(d.get('e2e_step_graph_check'))
e=d['e2e']; print('e2e', {k: (round(e[k]['speedup_vs_plain'],3), round(e[k]['warm_speedup_vs_plain'],3)) for k in ('chain', 'ddtree_16') if k in e})
print('ms/round (draft, verify, commit)', {k: tuple(round(e[k]['engine'][p],3) for p in ('draft_ms_per_round','verify_ms_per_round','commit_ms_per_round')) for k in ('plain', 'chain', 'ddtree_16') if 'engine' in e.get(k, {})})
" $1 2>&1 | cut -c1-1500
}
OFF="DFLASH_HYBRID_VERIFY_LT=0 DFLASH_HYBRID_FUSED_TREE=0 DFLASH_BATCHED_GDN_SETTLE=0 DFLASH_MOE_GATHER_KERNEL=0"
CHUNK="DFLASH_GDN_TREE_CHUNKED=1"
for v in on off; do
  left=$(( LIMIT - 20 - $(el) )); [ $left -gt 60 ] || break
  env $([ $v = off ] && echo $OFF) $([ $v = chunk ] && echo $CHUNK) timeout $(( left < 150 ? left : 150 )) /tmp/b/dflash-serve bench --model qwen3.6-27b --prefill 1024 --e2e-prompt 1024 \
    --e2e-tokens $TOKENS --budgets 16 --e2e-profile --out $OUT/l2/h27-$v.json > $OUT/l2/h27-$v.log 2>&1
  echo "27b $v rc=$? at $(el) s"; grep -m2 -i "error\|panic" $OUT/l2/h27-$v.log | cut -c1-300; summary $OUT/l2/h27-$v.json
done
for v in on off; do
  left=$(( LIMIT - $(el) )); [ $left -gt 100 ] || break
  env $([ $v = off ] && echo $OFF) $([ $v = chunk ] && echo $CHUNK) timeout 90 /tmp/b/dflash-serve bench --model qwen3.6-35b-a3b --prefill 1024 \
    --e2e-prompt 1024 --e2e-tokens 128 --budgets 16 --e2e-profile --out $OUT/l2/h35-$v.json > $OUT/l2/h35-$v.log 2>&1
  echo "35b-a3b $v rc=$? at $(el) s"; grep -m2 -i "error\|panic" $OUT/l2/h35-$v.log | cut -c1-300; summary $OUT/l2/h35-$v.json
done
tar -C $OUT -cJf $OUT/l2.tar.xz l2 && rm -rf $OUT/l2
echo "done at $(el) s"
