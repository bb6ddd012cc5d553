#!/usr/bin/env bash
# Session 31 (issue 20): on an H200, call L2 cut to LIMIT=240 (issue 20's H200 figures on the new
# defaults); on any other card, the 27B engine with DDTree-64 (trees past 32 nodes: the chunked
# GDN tree form, on by default since b78c202) against DFLASH_GDN_TREE_CHUNKED=0: greedy tokens
# against plain decoding and the e2e figures. Bundle: dflash-serve + gpu_check. ~200 s.
set -u
D=${D:-.gpu-next}
if nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then
  LIMIT=240 D=$D bash deploy/bench/next/callL2-hybrid-defaults.sh; exit
fi
mkdir -p /tmp/b && tar -xJf $D/bundle.tar.xz -C /tmp/b && . /tmp/b/env.sh
T0=$(date +%s); el() { echo $(( $(date +%s) - T0 )); }
mkdir -p $OUT/l3
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee $OUT/l3/gpu.txt; cat $D/BUILT
for c in 1 0; do
  DFLASH_GDN_TREE_CHUNKED=$c timeout 110 /tmp/b/dflash-serve bench --model qwen3.6-27b --prefill 1024 --e2e-prompt 1024 \
    --e2e-tokens 128 --budgets 16,64 --e2e-profile --out $OUT/l3/h27-c$c.json > $OUT/l3/h27-c$c.log 2>&1
  echo "27b chunked=$c rc=$? at $(el) s"; grep -m2 -i "error\|panic" $OUT/l3/h27-c$c.log | cut -c1-300
  python3 -c "
import json,sys; d=json.load(open(sys.argv[1]))
print(d.get('e2e_step_graph_check'))
e=d['e2e']; print('e2e', {k: (round(e[k]['speedup_vs_plain'],3), round(e[k]['warm_speedup_vs_plain'],3), e[k].get('tokens_match', e[k].get('identical'))) for k in e if isinstance(e[k], dict) and 'speedup_vs_plain' in e[k]})
print('ms/round (draft, verify, commit)', {k: tuple(round(e[k]['engine'][p],3) for p in ('draft_ms_per_round','verify_ms_per_round','commit_ms_per_round')) for k in e if isinstance(e[k], dict) and 'engine' in e[k]})
" $OUT/l3/h27-c$c.json 2>&1 | cut -c1-1500
done
tar -C $OUT -cJf $OUT/l3.tar.xz l3 && rm -rf $OUT/l3
echo "done at $(el) s"
