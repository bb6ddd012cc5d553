#!/usr/bin/env bash
# Issue 20 (bundle: dflash-serve + gpu_check at or after c53f1c3): the decode commit without copies
# (StagedState::OwnRows: the engine's 8_commit phase was 1.39 ms of a 27B decode step on an H100),
# PDL without the weight pull (off, then on), the chunked prefill on by default, and the
# hybrid checks with the GDN chain's last-row and in-place forms (must equal every-row bit for bit).
set -u
D=${D:-.gpu-next}
mkdir -p /tmp/b && tar -xJf $D/bundle.tar.xz -C /tmp/b && . /tmp/b/env.sh
T0=$(date +%s); el() { echo $(( $(date +%s) - T0 )); }
mkdir -p $OUT/n
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/n/gpu.txt; cat $D/BUILT
for pdl in 0 1; do
  DFLASH_PDL=$pdl timeout 100 /tmp/b/dflash-serve bench --model qwen3.6-27b --prefill 1024 --e2e-prompt 1024 \
    --e2e-tokens 64 --budgets 16 --e2e-profile --out $OUT/n/h27-pdl$pdl.json > $OUT/n/h27-pdl$pdl.log 2>&1
  echo "27b pdl=$pdl rc=$? at $(el) s"; grep -m2 -i "error\|panic" $OUT/n/h27-pdl$pdl.log | cut -c1-300
  python3 -c "
import json,sys; d=json.load(open(sys.argv[1]))
print({k: (round(v['ms_per_token'],3), round(v['fraction_of_roofline'],4)) for k, v in d.items() if k.startswith('decode_') and 'ms_per_token' in v})
print(d.get('e2e_step_graph_check'))
print({k: v for k, v in d.get('kernel_checks', {}).items() if not k.startswith('attention_varlen')})
e=d['e2e']; print('e2e', {k: (round(e[k]['speedup_vs_plain'],3), round(e[k]['warm_speedup_vs_plain'],3)) for k in ('chain', 'ddtree_16') if k in e})
print('commit ms/round', {k: round(e[k]['engine']['8_commit']['ms_per_round'],3) for k in ('plain', 'chain', 'ddtree_16') if 'engine' in e.get(k, {})})
print('verify ms/round', {k: round(e[k]['engine']['6_verify_forward']['ms_per_round'],3) for k in ('plain', 'chain', 'ddtree_16') if 'engine' in e.get(k, {})})
" $OUT/n/h27-pdl$pdl.json 2>&1 | cut -c1-3000
done
( cd /tmp/b && timeout $(( ${LIMIT:-240} - $(el) )) ./gpu_check cuda $OUT/n/hybrid.json --hybrid > $OUT/n/hybrid.log 2>&1; echo "hybrid rc=$? at $(el) s" )
python3 - $OUT/n/hybrid.json <<'PY' 2>&1 | cut -c1-2500
import json, sys
d = json.load(open(sys.argv[1]))
def walk(x, path=""):
    if isinstance(x, dict):
        for k, v in x.items(): walk(v, f"{path}.{k}" if path else k)
    elif "profile" not in path and any(s in path for s in ("in_place", "bit_exact", "not_bit_equal", "decode_1.ms", "decode_1.fraction", "verify_chain_16.ms", "verify_tree_64_ddtree_like_depth16.ms", "last_conv_window")):
        print(path, str(x)[:120])
walk(d)
PY
tar -C $OUT -cJf $OUT/n.tar.xz n && rm -rf $OUT/n
echo "done at $(el) s"
