#!/usr/bin/env bash
# Session 29, for an H200: the one-launch o-projection + router + routing checked first (Coder
# `gpu_check --moe` with DFLASH_MOE_OPROJ_ROUTER=1: `moe_oproj_router_route` bit for bit, decode
# with it in the graph; and the q/k/v GEMV prefetching the o-projection, DFLASH_MOE_PREFETCH_O, and
# gate/up prefetching the experts' down weights, DFLASH_MOE_PREFETCH_DOWN),
# then callO-issue20.sh (every issue-20 Done-when figure, the Coder and
# 35B-A3B with PDL off and on, ncu tables). ~390 s.
set -u
D=${D:-.gpu-next}
mkdir -p /tmp/b && tar -xJf $D/bundle.tar.xz -C /tmp/b && . /tmp/b/env.sh
mkdir -p $OUT/w
export DFLASH_TESTS_DIR=$PWD/tests
for v in o1p0d0 o0p1d0 o0p0d1 o1p1d1; do
  o=${v:1:1}; p=${v:3:1}; dn=${v:5:1}
  DFLASH_MOE_OPROJ_ROUTER=$o DFLASH_MOE_PREFETCH_O=$p DFLASH_MOE_PREFETCH_DOWN=$dn timeout 60 /tmp/b/gpu_check cuda $OUT/w/coder-$v.json --moe > $OUT/w/coder-$v.log 2>&1; echo "coder $v rc=$?"
  python3 -c "
import json,sys; d=json.load(open(sys.argv[1])); b=d['qwen3_coder_30b_a3b_shape_bench']; f=d['moe_target_fused_vs_plain_4_layers']['decode_1']
print('coder $v', round(b['decode_1']['graph_ms'],3), round(b['decode_1']['eager_ms'],3), round(b['decode_1']['fraction_of_roofline'],3), 'chain16', round(b['verify_chain_16']['graph_ms'],3), 'decode vs plain / graph vs eager', f['graph_vs_plain'], f['graph_vs_eager']['max_abs_diff'])
print('oproj_router_route', str(d.get('moe_oproj_router_route'))[:500])
" $OUT/w/coder-$v.json 2>&1 | cut -c1-700
done
tar -C $OUT -cJf $OUT/w.tar.xz w && rm -rf $OUT/w
LIMIT=420 bash deploy/bench/next/callO-issue20.sh
