#!/usr/bin/env bash
# Main's head after session 28 (PDL on, gattn_split2 on, no GEMV preload) checked and timed as
# shipped: Coder `gpu_check --moe` (router_route and the new one-launch o-projection + router +
# routing, `moe_oproj_router_route`, bit for bit against the launches they replace; graph vs
# eager), then the Coder with that launch in the decode (`DFLASH_MOE_OPROJ_ROUTER=1`: decode
# against the first run's, the 4-layer forward against the plain one), the same with the q/k/v
# GEMV prefetching the o-projection into L2 (`DFLASH_MOE_PREFETCH_O=1`) and gate/up prefetching
# the experts' down weights (`DFLASH_MOE_PREFETCH_DOWN=1`, also on the 35B-A3B), the 27B and 35B-A3B
# through the engine (greedy tokens graphs vs eager), Qwen3-8B decode. ~230 s on an H100.
set -u
D=${D:-.gpu-next}
mkdir -p /tmp/b && tar -xJf $D/bundle.tar.xz -C /tmp/b && . /tmp/b/env.sh
T0=$(date +%s); el() { echo $(( $(date +%s) - T0 )); }
mkdir -p $OUT/v
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/v/gpu.txt; cat $D/BUILT
export DFLASH_TESTS_DIR=$PWD/tests
# Variants o<oproj_router>p<prefetch_o>d<prefetch_down>, the first and last twice
# (interleaved) for the noise.
for v in o0p0d0 o1p0d0 o0p1d0 o0p0d1 o1p1d1 o0p0d0 o1p1d1; do
  o=${v:1:1}; p=${v:3:1}; dn=${v:5:1}
  DFLASH_MOE_OPROJ_ROUTER=$o DFLASH_MOE_PREFETCH_O=$p DFLASH_MOE_PREFETCH_DOWN=$dn timeout 60 /tmp/b/gpu_check cuda $OUT/v/coder-$v.json --moe > $OUT/v/coder-$v.log 2>&1; echo "coder $v rc=$? at $(el) s"
  python3 -c "
import json,sys; d=json.load(open(sys.argv[1])); b=d['qwen3_coder_30b_a3b_shape_bench']; f=d['moe_target_fused_vs_plain_4_layers']['decode_1']
print('coder $v', round(b['decode_1']['graph_ms'],3), round(b['decode_1']['eager_ms'],3), round(b['decode_1']['fraction_of_roofline'],3), 'chain16', round(b['verify_chain_16']['graph_ms'],3), 'router_route', d['moe_router_route'].get('pass'), 'block', d['moe_block'].get('pass'), d['moe_hybrid_block'].get('pass'), 'decode vs plain / graph vs eager', f['graph_vs_plain'], f['graph_vs_eager']['max_abs_diff'])
print('oproj_router_route', str(d.get('moe_oproj_router_route'))[:500])
" $OUT/v/coder-$v.json 2>&1 | cut -c1-900
done
for m in qwen3.6-27b qwen3.6-35b-a3b qwen3.6-35b-a3b-d1; do
  [ $m = qwen3.6-35b-a3b-d1 ] && export DFLASH_MOE_PREFETCH_DOWN=1
  timeout 60 /tmp/b/dflash-serve bench --model ${m%-d1} --prefill 1024 --e2e-prompt 1024 --e2e-tokens 64 --budgets 16 \
    --out $OUT/v/$m.json > $OUT/v/$m.log 2>&1; echo "$m rc=$? at $(el) s"
  python3 -c "
import json,sys; d=json.load(open(sys.argv[1])); a=d['decode_through_engine']; b=[v for k, v in d.items() if k.startswith('decode_step_graphs_')][0]; e=d['e2e']; c=d.get('e2e_step_graph_check', {})
print('$m', round(a['ms_per_token'],3), round(a['fraction_of_roofline'],3), 'other way', round(b['ms_per_token'],3), 'e2e', {k: (round(e[k].get('speedup_vs_plain'),2), round(e[k].get('warm_speedup_vs_plain'),2)) for k in ('chain', 'ddtree_16') if k in e}, 'identical', [v.get('identical') for v in c.values()])
" $OUT/v/$m.json 2>&1 | cut -c1-400
done
unset DFLASH_MOE_PREFETCH_DOWN
timeout 60 /tmp/b/dflash-serve bench --model qwen3-8b --variants fast --contexts 1024 --batch-sizes --sizes 1 --budgets 16 \
  --e2e-tokens 64 --out $OUT/v/q8.json > $OUT/v/q8.log 2>&1; echo "q8 rc=$? at $(el) s"
python3 -c "import json,sys; d=json.load(open(sys.argv[1])); f=d['variants']['fast']; x=f['decode']; print('q8', round(x['ctx_1024_cuda_graph']['ms'],3), round(x['ctx_1024']['ms'],3), 'identical', [v.get('identical') for v in f.get('e2e_step_graph_check', {}).values() if isinstance(v, dict)])" $OUT/v/q8.json 2>&1 | cut -c1-300
tar -C $OUT -cJf $OUT/v.tar.xz v && rm -rf $OUT/v
echo "done at $(el) s"
