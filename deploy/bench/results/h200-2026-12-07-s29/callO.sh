#!/usr/bin/env bash
# Issue 20, session 27's first call (bundle: dflash-serve + gpu_check): every Done-when figure of
# the hybrid and MoE shapes in one call (the Done-when names the H200), then where a sparse-MoE
# decode step's time goes per kernel (no MoE ncu table exists yet):
#   1. gpu_check --hybrid: 27B decode fraction, chain-16 and 64-node tree over decode, the
#      recurrent-state memory per tree verify, graph vs eager bit for bit (also confirms the
#      gated attention's live splits, 1ab5788, change no bits);
#   2. the 27B through the engine: decode, e2e chain / DDTree-16 with token checks, phases;
#   3. the 27B 4K prefill (chunked delta rule, the default);
#   4. Qwen3-Coder-30B-A3B, all 48 layers (gpu_check --moe); Qwen3.6-35B-A3B, all 40 (bench);
#   5. ncu: the Coder cut to 4 layers, then the 35B-A3B cut to 12 layers, our kernels only.
set -u
D=${D:-.gpu-next}
mkdir -p /tmp/b && tar -xJf $D/bundle.tar.xz -C /tmp/b && . /tmp/b/env.sh
T0=$(date +%s); el() { echo $(( $(date +%s) - T0 )); }
mkdir -p $OUT/o
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee $OUT/o/gpu.txt; cat $D/BUILT
export DFLASH_TESTS_DIR=$PWD/tests
( cd /tmp/b && timeout 150 ./gpu_check cuda $OUT/o/hybrid.json --hybrid > $OUT/o/hybrid.log 2>&1; echo "hybrid rc=$? at $(el) s" )
python3 - $OUT/o/hybrid.json <<'PY' 2>&1 | cut -c1-2600
import json, sys
d = json.load(open(sys.argv[1]))
def walk(x, path=""):
    if isinstance(x, dict):
        for k, v in x.items(): walk(v, f"{path}.{k}" if path else k)
    elif "profile" not in path and "by_split" not in path and any(s in path for s in (
            "in_place", "graph_vs_eager", "bit_exact", "pass", "decode_1.ms", "decode_1.fraction",
            "verify_chain_16.ms", "verify_tree", "over_decode", "recurrent_", "copy_bandwidth")):
        print(path, str(x)[:120])
walk(d)
PY
timeout 120 /tmp/b/dflash-serve bench --model qwen3.6-27b --prefill 1024 --e2e-prompt 1024 \
  --e2e-tokens 64 --budgets 16 --e2e-profile --out $OUT/o/h27.json > $OUT/o/h27.log 2>&1
echo "27b rc=$? at $(el) s"; grep -m2 -i "error\|panic" $OUT/o/h27.log | cut -c1-300
python3 -c "
import json,sys; d=json.load(open(sys.argv[1]))
print({k: (round(v['ms_per_token'],3), round(v['fraction_of_roofline'],4)) for k, v in d.items() if k.startswith('decode_') and isinstance(v, dict) and 'ms_per_token' in v})
print(d.get('e2e_step_graph_check'))
print({k: v for k, v in d.get('kernel_checks', {}).items() if not k.startswith('attention_varlen')})
e=d['e2e']; print('e2e', {k: (round(e[k]['speedup_vs_plain'],3), round(e[k]['warm_speedup_vs_plain'],3), e[k].get('tokens_match')) for k in ('chain', 'ddtree_16') if k in e})
print('phases ms/round', {k: {p: round(v['ms_per_round'],3) for p, v in e[k]['engine'].items()} for k in ('plain', 'chain') if 'engine' in e.get(k, {})})
" $OUT/o/h27.json 2>&1 | cut -c1-3000
timeout 120 /tmp/b/dflash-serve bench --model qwen3.6-27b --prefill 4096 --e2e-prompt 1024 \
  --e2e-tokens 32 --budgets 16 --no-e2e-check --out $OUT/o/h27-4k.json > $OUT/o/h27-4k.log 2>&1
echo "27b 4k rc=$? at $(el) s"
python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print({k: d[k] for k in d if k.startswith('prefill_') and not k.endswith('phases')}); print({a: round(b['ms'],1) for a,b in d['prefill_4096_phases']['phases'].items()})" $OUT/o/h27-4k.json 2>&1 | cut -c1-1200
timeout 150 /tmp/b/gpu_check cuda $OUT/o/coder.json --moe > $OUT/o/coder.log 2>&1
echo "coder rc=$? at $(el) s"
python3 -c "import json,sys; d=json.load(open(sys.argv[1])); b=d['qwen3_coder_30b_a3b_shape_bench']; print({k: b[k] for k in b if not isinstance(b[k], (list,))}); print('block pass', d['moe_block'].get('pass'))" $OUT/o/coder.json 2>&1 | cut -c1-1500
timeout 150 /tmp/b/dflash-serve bench --model qwen3.6-35b-a3b --prefill 1024 --e2e-prompt 1024 \
  --e2e-tokens 64 --budgets 16 --e2e-profile --out $OUT/o/h35.json > $OUT/o/h35.log 2>&1
echo "35b-a3b rc=$? at $(el) s"; grep -m2 -i "error\|panic" $OUT/o/h35.log | cut -c1-300
python3 -c "
import json,sys; d=json.load(open(sys.argv[1]))
print({k: d[k] for k in d if k.startswith(('prefill_', 'decode_', 'verify')) and not k.endswith('phases')})
e=d['e2e']; print('e2e', {k: (e[k].get('speedup_vs_plain'), e[k].get('warm_speedup_vs_plain'), e[k].get('tokens_match')) for k in ('chain', 'ddtree_16') if k in e})
print('phases ms/round', {k: {p: round(v['ms_per_round'],3) for p, v in e[k]['engine'].items()} for k in ('plain', 'chain') if 'engine' in e.get(k, {})})
" $OUT/o/h35.json 2>&1 | cut -c1-2500
# PDL (on by default since session 28) against it off on this card: Coder and 35B-A3B again
# with DFLASH_PDL=0:
DFLASH_PDL=0 timeout 100 /tmp/b/gpu_check cuda $OUT/o/coder-pdl0.json --moe > $OUT/o/coder-pdl0.log 2>&1
echo "coder pdl=0 rc=$? at $(el) s"
python3 -c "import json,sys; d=json.load(open(sys.argv[1])); b=d['qwen3_coder_30b_a3b_shape_bench']; print({k: b[k] for k in b if not isinstance(b[k], (list,))}); print('block pass', d['moe_block'].get('pass'))" $OUT/o/coder-pdl0.json 2>&1 | cut -c1-1500
DFLASH_PDL=0 timeout 120 /tmp/b/dflash-serve bench --model qwen3.6-35b-a3b --prefill 1024 --e2e-prompt 1024 \
  --e2e-tokens 64 --budgets 16 --out $OUT/o/h35-pdl0.json > $OUT/o/h35-pdl0.log 2>&1
echo "35b-a3b pdl=0 rc=$? at $(el) s"
python3 -c "
import json,sys; d=json.load(open(sys.argv[1]))
print({k: d[k] for k in d if k.startswith(('decode_', 'verify')) and not k.endswith('phases')})
e=d['e2e']; print('e2e', {k: (e[k].get('speedup_vs_plain'), e[k].get('warm_speedup_vs_plain'), e[k].get('tokens_match')) for k in ('chain', 'ddtree_16') if k in e})
" $OUT/o/h35-pdl0.json 2>&1 | cut -c1-1500
OURS='regex:^(moe_|gemv_|row_sumsq|rms_apply|gdn_|gattn_|argmax|topk|attn_|splitk_|kv_norm|qk_norm|add_rmsnorm|silu_mul)'
LEFT=$(( ${LIMIT:-560} - $(el) ))
if [ $LEFT -gt 60 ]; then
  timeout $(( LEFT / 2 )) ncu --clock-control none --metrics gpu__time_duration.sum --csv --kernel-name "$OURS" \
    /tmp/b/gpu_check cuda /tmp/coder4.json --moe --moe-layers=4 > /tmp/coder.csv 2>$OUT/o/coder-ncu.err
  echo "coder ncu rc=$? at $(el) s"
  python3 deploy/bench/next/ncu_mean.py /tmp/coder.csv > $OUT/o/coder_kernels.txt; head -30 $OUT/o/coder_kernels.txt
  xz -9 -c /tmp/coder.csv > $OUT/o/coder_ncu.csv.xz
fi
LEFT=$(( ${LIMIT:-560} - $(el) ))
if [ $LEFT -gt 40 ]; then
  timeout $LEFT ncu --clock-control none --metrics gpu__time_duration.sum --csv --kernel-name "$OURS" \
    -c 3000 /tmp/b/dflash-serve bench --model deploy/bench/next/qwen3.6-35b-a3b-12-layers.json --e2e-only \
    --prefill 64 --e2e-prompt 64 --e2e-tokens 24 --budgets 16 --no-e2e-check > /tmp/h35.csv 2>$OUT/o/h35-ncu.err
  echo "h35 ncu rc=$? at $(el) s"
  python3 deploy/bench/next/ncu_mean.py /tmp/h35.csv > $OUT/o/h35_kernels.txt; head -30 $OUT/o/h35_kernels.txt
  xz -9 -c /tmp/h35.csv > $OUT/o/h35_ncu.csv.xz
fi
tar -C $OUT -cJf $OUT/o.tar.xz o && rm -rf $OUT/o
echo "done at $(el) s"
