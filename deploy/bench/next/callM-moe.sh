#!/usr/bin/env bash
# Issue 20 (bundle: dflash-serve + gpu_check at or after 4f6b8ae): the MoE shapes' decode with
# programmatic dependent launch over the whole step (DFLASH_PDL=1) against without, and the
# dense Qwen3-8B's the same way:
#   1. Qwen3-Coder-30B-A3B, all 48 layers (gpu_check --moe: block checks, decode graph / eager /
#      plain, chain-16, prefill 1K with the wide routing), PDL off then on;
#   2. Qwen3.6-35B-A3B, all 40 layers (70 GB): decode, e2e with token checks, PDL on;
#   3. Qwen3-8B fast variant: decode, e2e and kernel checks, PDL off then on.
set -u
D=${D:-.gpu-next}
mkdir -p /tmp/b && tar -xJf $D/bundle.tar.xz -C /tmp/b && . /tmp/b/env.sh
T0=$(date +%s); el() { echo $(( $(date +%s) - T0 )); }
mkdir -p $OUT/m
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/m/gpu.txt
cat $D/BUILT
for pdl in 0 1; do
  DFLASH_PDL=$pdl timeout 150 /tmp/b/gpu_check cuda $OUT/m/coder-pdl$pdl.json --moe > $OUT/m/coder-pdl$pdl.log 2>&1
  echo "coder pdl=$pdl rc=$? at $(el) s"
  python3 -c "import json,sys; d=json.load(open(sys.argv[1])); b=d['qwen3_coder_30b_a3b_shape_bench']; print({k: b[k] for k in b if not isinstance(b[k], (list,))}); print('block pass', d['moe_block'].get('pass'))" $OUT/m/coder-pdl$pdl.json 2>&1 | cut -c1-1500
done
DFLASH_PDL=1 timeout 150 /tmp/b/dflash-serve bench --model qwen3.6-35b-a3b --prefill 1024 --e2e-prompt 1024 \
  --e2e-tokens 64 --budgets 16 --out $OUT/m/h35-pdl1.json > $OUT/m/h35-pdl1.log 2>&1
echo "35b-a3b pdl=1 rc=$? at $(el) s"; grep -m2 -i "error\|panic" $OUT/m/h35-pdl1.log | cut -c1-300
python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print({k: d[k] for k in d if k.startswith(('prefill_', 'decode_', 'verify', 'e2e_step')) and not k.endswith('phases')}); print(d.get('kernel_checks')); e=d['e2e']; print('e2e', {k: (e[k].get('speedup_vs_plain'), e[k].get('warm_speedup_vs_plain'), e[k].get('tokens_match')) for k in ('chain', 'ddtree_16') if k in e})" $OUT/m/h35-pdl1.json 2>&1 | cut -c1-2500
for pdl in 0 1; do
  [ $(( 560 - $(el) )) -gt 80 ] || break
  DFLASH_PDL=$pdl timeout 75 /tmp/b/dflash-serve bench --model qwen3-8b --variants fast --contexts 1024 --batch-sizes \
    --sizes 1,16 --budgets 16 --e2e-tokens 64 --out $OUT/m/q8-pdl$pdl.json > $OUT/m/q8-pdl$pdl.log 2>&1
  echo "qwen3-8b pdl=$pdl rc=$? at $(el) s"
  python3 -c "import json,sys; d=json.load(open(sys.argv[1])); f=d['variants']['fast']; print('decode', json.dumps(f.get('decode'))[:600]); print('e2e', json.dumps(f.get('e2e'))[:700]); print('checks', json.dumps(d.get('kernel_checks'))[:700])" $OUT/m/q8-pdl$pdl.json 2>&1 | cut -c1-2200
done
tar -C $OUT -cJf $OUT/m.tar.xz m && rm -rf $OUT/m
echo "done at $(el) s"
