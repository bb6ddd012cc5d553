#!/usr/bin/env bash
# Session 30 (issue 20): the hybrid verify's products on cuBLASLt (DFLASH_HYBRID_VERIFY_LT,
# off by default until this call) against the skinny GEMMs, on one machine:
#   1. gpu_check --hybrid: every hybrid check and figure as in call O, plus `verify_lt` (chain-16
#      and both 64-node trees timed each way, phases each way, logits and a decode after a
#      committed path compared with the default; the trees also on the fused tree forward,
#      DFLASH_HYBRID_FUSED_TREE, off by default until this call), and the gated-attention
#      kernels on a 64-node tree (ancestor bits) against the plain ops (`fused_attention_layer_
#      vs_plain.*_tree64`), and the commit settled on all GDN layers in one batch
#      (DFLASH_BATCHED_GDN_SETTLE, off by default until this call: `verify_lt.batched_settle`,
#      bit for bit against layer by layer);
#   2. the 27B through the engine, 256 generated tokens (a 64-token run is 10 rounds, too few
#      for the steady state), the three switches off then on;
#   3. the 35B-A3B through the engine (128 tokens) both ways, if time is left;
#   4. the MoE row gather kernel (DFLASH_MOE_GATHER_KERNEL=1): `gpu_check --moe`'s expert paths
#      and the Coder's 4K prefill phases with it off and on, if time is left.
# Bundle: dflash-serve + gpu_check. ~450 s; LIMIT (default 560) caps the call, TOKENS (default
# 256) the engine runs' generated tokens.
set -u
LIMIT=${LIMIT:-560}; TOKENS=${TOKENS:-256}
D=${D:-.gpu-next}
mkdir -p /tmp/b && tar -xJf $D/bundle.tar.xz -C /tmp/b && . /tmp/b/env.sh
T0=$(date +%s); el() { echo $(( $(date +%s) - T0 )); }
mkdir -p $OUT/l
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee $OUT/l/gpu.txt; cat $D/BUILT
export DFLASH_TESTS_DIR=$PWD/tests
( cd /tmp/b && timeout $(( LIMIT < 400 ? LIMIT / 2 : 200 )) ./gpu_check cuda $OUT/l/hybrid.json --hybrid > $OUT/l/hybrid.log 2>&1; echo "hybrid rc=$? at $(el) s" )
python3 - $OUT/l/hybrid.json <<'PY' 2>&1 | cut -c1-3000
import json, sys
d = json.load(open(sys.argv[1]))
h = d.get("qwen3_6_27b_shape_bf16", d)
for k in ("decode_1", "verify_chain_16", "verify_tree_64_binary_depth6", "verify_tree_64_ddtree_like_depth16"):
    print(k, {a: h.get(k, {}).get(a) for a in ("ms", "fraction_of_roofline")})
lt = h.get("verify_lt", {})
for k, v in lt.items():
    if not isinstance(v, dict):
        print(k, v); continue
    for w in ("default", "lt", "fused_tree"):
        if w in v:
            e = v[w]
            print(k, w, round(e["ms"], 3), round(e["over_decode"], 4), "vs default", e.get("vs_default"),
                  "commit+decode", e.get("commit_path_then_decode_vs_default"))
            print("   ", {p: round(q["ms"], 3) for p, q in e["profile"].items() if isinstance(q, dict)})
    if "error" in v: print(k, v["error"][:400])
    if k == "batched_settle": print(k, v)
for k, v in h.get("fused_attention_layer_vs_plain", {}).items():
    print("attn", k, {a: v.get(a) for a in ("pass", "out_rel_err", "wrong_case_rejected", "wrong_tree_run_as_chain_rel_err", "fused_us_per_call", "plain_us_per_call_incl_cache_copy")})
g = h.get("gdn_paths_whole_model", {}).get("split_inputs", {})
print("split_inputs verify/decode", g.get("verify_16_over_decode"), "vs plain", g.get("vs_plain", {}).get("verify_chain_16"))
PY
for lt in 0 1; do
  left=$(( LIMIT - 20 - $(el) )); [ $left -gt 60 ] || break
  DFLASH_HYBRID_VERIFY_LT=$lt DFLASH_HYBRID_FUSED_TREE=$lt DFLASH_BATCHED_GDN_SETTLE=$lt timeout $(( left < 170 ? left : 170 )) /tmp/b/dflash-serve bench --model qwen3.6-27b --prefill 1024 --e2e-prompt 1024 \
    --e2e-tokens $TOKENS --budgets 16 --e2e-profile --out $OUT/l/h27-lt$lt.json > $OUT/l/h27-lt$lt.log 2>&1
  echo "27b lt$lt rc=$? at $(el) s"; grep -m2 -i "error\|panic" $OUT/l/h27-lt$lt.log | cut -c1-300
  python3 -c "
import json,sys; d=json.load(open(sys.argv[1]))
print({k: (round(v['ms_per_token'],3), round(v['fraction_of_roofline'],4)) for k, v in d.items() if k.startswith('decode_') and isinstance(v, dict) and 'ms_per_token' in v})
print(d.get('e2e_step_graph_check'))
print({k: v for k, v in d.get('kernel_checks', {}).items() if not k.startswith('attention_varlen')})
e=d['e2e']; print('e2e', {k: (round(e[k]['speedup_vs_plain'],3), round(e[k]['warm_speedup_vs_plain'],3), e[k].get('tokens_match')) for k in ('chain', 'ddtree_16') if k in e})
print('phases ms/round', {k: {p: round(v['ms_per_round'],3) for p, v in e[k]['engine'].items()} for k in ('plain', 'chain', 'ddtree_16') if 'engine' in e.get(k, {})})
" $OUT/l/h27-lt$lt.json 2>&1 | cut -c1-3000
done
# The sparse-MoE hybrid: its chain and DDTree-16 verifies take the same forms.
for lt in 0 1; do
  left=$(( LIMIT - $(el) )); [ $left -gt 200 ] || break
  DFLASH_HYBRID_VERIFY_LT=$lt DFLASH_HYBRID_FUSED_TREE=$lt DFLASH_BATCHED_GDN_SETTLE=$lt timeout 90 /tmp/b/dflash-serve bench --model qwen3.6-35b-a3b --prefill 1024 \
    --e2e-prompt 1024 --e2e-tokens 128 --budgets 16 --e2e-profile --out $OUT/l/h35-lt$lt.json > $OUT/l/h35-lt$lt.log 2>&1
  echo "35b-a3b lt$lt rc=$? at $(el) s"; grep -m2 -i "error\|panic" $OUT/l/h35-lt$lt.log | cut -c1-300
  python3 -c "
import json,sys; d=json.load(open(sys.argv[1]))
print(d.get('e2e_step_graph_check'))
e=d['e2e']; print('e2e', {k: (round(e[k]['speedup_vs_plain'],3), round(e[k]['warm_speedup_vs_plain'],3), e[k].get('tokens_match')) for k in ('chain', 'ddtree_16') if k in e})
print('phases ms/round', {k: {p: round(v['ms_per_round'],3) for p, v in e[k]['engine'].items()} for k in ('plain', 'chain', 'ddtree_16') if 'engine' in e.get(k, {})})
" $OUT/l/h35-lt$lt.json 2>&1 | cut -c1-2000
done
left=$(( LIMIT - $(el) ))
if [ $left -gt 150 ]; then
  DFLASH_MOE_GATHER_KERNEL=1 timeout 80 /tmp/b/gpu_check cuda $OUT/l/coder-k1.json --moe > $OUT/l/coder-k1.log 2>&1; echo "gpu_check k1 rc=$? at $(el) s"
  python3 -c "
import json,sys; m=json.load(open(sys.argv[1]))['moe_block']; print('moe_block pass', m.get('pass'), m.get('rows_1000', {}).get('expert_paths'))
" $OUT/l/coder-k1.json 2>&1 | cut -c1-900
  for k in 0 1; do
    DFLASH_MOE_GATHER_KERNEL=$k timeout 60 /tmp/b/dflash-serve bench --model qwen3-coder-30b-a3b --prefill 4096 --e2e-prompt 256 --e2e-tokens 8 \
      --budgets 16 --no-e2e-check --out $OUT/l/coder-k$k.json > $OUT/l/coder-k$k.log 2>&1
    echo "coder k$k rc=$? at $(el) s"
    python3 -c "
import json,sys; d=json.load(open(sys.argv[1])); p=d['prefill_4096']; ph=d['prefill_4096_phases']
print('k$k prefill s', round(p['seconds'],4), {k: round(v['ms'],2) for k, v in ph['phases'].items()})
" $OUT/l/coder-k$k.json 2>&1 | cut -c1-900
  done
fi
tar -C $OUT -cJf $OUT/l.tar.xz l && rm -rf $OUT/l
echo "done at $(el) s"
