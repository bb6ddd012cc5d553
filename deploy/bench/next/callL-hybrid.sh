#!/usr/bin/env bash
# Issue 20 (bundle: dflash-serve + gpu_check at or after 4f6b8ae): the GDN decode without copies
# (gdn_chain reads the window and the new rows in place, the gated norm writes the window to keep;
# the decode graph advances its own state in place and hands it to the cache) and programmatic
# dependent launch over the whole decode step (DFLASH_PDL=1: GEMMs, GDN, gated attention, decode
# attention, MoE decode kernels). In order of need:
#   1. gpu_check --gdn-chunk: the chunked delta rule's second form (fixed launch constants)
#      against the scan (flip DFLASH_GDN_CHUNKED on if every case passes and is faster);
#   2. gpu_check --hybrid: the fused layer checks (gdn_layer.t1/t16.last_row_and_in_place_max_diff
#      must be 0), the decode graph against eager bit for bit (graph_vs_eager);
#   3. the 27B shape's decode, eager and graphs, e2e with token checks: PDL off, then on;
#   4. the 27B 4K prefill with the chunked form on;
#   5. ncu of the 27B decode step per kernel (callK), with the time left.
set -u
D=${D:-.gpu-next}
mkdir -p /tmp/b && tar -xJf $D/bundle.tar.xz -C /tmp/b && . /tmp/b/env.sh
T0=$(date +%s); el() { echo $(( $(date +%s) - T0 )); }
mkdir -p $OUT/l
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/l/gpu.txt
cat $D/BUILT
timeout 90 /tmp/b/gpu_check cuda $OUT/l/gdn.json --gdn-chunk > $OUT/l/gdn.log 2>&1
echo "gdn-chunk rc=$? at $(el) s"; tail -1 $OUT/l/gdn.log | cut -c1-1500
( cd /tmp/b && DFLASH_TESTS_DIR=$OLDPWD/tests timeout 200 ./gpu_check cuda $OUT/l/hybrid.json --hybrid > $OUT/l/hybrid.log 2>&1; echo "hybrid rc=$? at $(el) s" )
python3 - $OUT/l/hybrid.json <<'PY' 2>&1 | cut -c1-2500
import json, sys
d = json.load(open(sys.argv[1]))
def walk(x, path=""):
    if isinstance(x, dict):
        for k, v in x.items(): walk(v, f"{path}.{k}" if path else k)
    elif "profile" not in path and "by_split" not in path and any(s in path for s in (
            "in_place", "graph_vs_eager", "differ", "pass", "decode_1.", "verify_chain_16.",
            "verify_tree", "over_decode", "fraction_of_roofline", "recurrent_", "copy_bandwidth",
            "prefill_1k", "error")):
        print(path, str(x)[:120])
walk(d)
PY
for pdl in 0 1; do
  DFLASH_PDL=$pdl timeout 120 /tmp/b/dflash-serve bench --model qwen3.6-27b --prefill 1024 --e2e-prompt 1024 \
    --e2e-tokens 64 --budgets 16 --e2e-profile --out $OUT/l/h27-pdl$pdl.json > $OUT/l/h27-pdl$pdl.log 2>&1
  echo "27b pdl=$pdl rc=$? at $(el) s"; grep -m2 -i "error\|panic" $OUT/l/h27-pdl$pdl.log | cut -c1-300
  python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print({k: d[k] for k in d if k.startswith(('decode_', 'e2e_step', 'verify'))}); print({k: v for k, v in d.get('kernel_checks', {}).items() if not k.startswith('gdn_chunk')}); e=d['e2e']; print('e2e', {k: (e[k].get('speedup_vs_plain'), e[k].get('warm_speedup_vs_plain'), e[k].get('tokens_match')) for k in ('chain', 'ddtree_16') if k in e}); print('plain phases', json.dumps(e.get('plain', {}).get('phases'))[:900])" $OUT/l/h27-pdl$pdl.json 2>&1 | cut -c1-3500
done
if [ $(( ${LIMIT:-560} - 20 - $(el) )) -gt 100 ]; then
  DFLASH_GDN_CHUNKED=1 timeout $(( ${LIMIT:-560} - $(el) )) /tmp/b/dflash-serve bench --model qwen3.6-27b --prefill 4096 --e2e-prompt 1024 \
    --e2e-tokens 32 --budgets 16 --no-e2e-check --out $OUT/l/h27-4k-chunked.json > $OUT/l/h27-4k-chunked.log 2>&1
  echo "27b 4k chunked rc=$? at $(el) s"
  python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print({k: d[k] for k in d if k.startswith('prefill_') and not k.endswith('phases')}); print({a: round(b['ms'],1) for a,b in d['prefill_4096_phases']['phases'].items()})" $OUT/l/h27-4k-chunked.json 2>&1 | cut -c1-1200
fi
# 5. Where the decode step's time goes, per kernel (callK's ncu), with what time is left.
LEFT=$(( ${LIMIT:-560} + 10 - $(el) ))
if [ $LEFT -gt 90 ]; then
  OURS='regex:^(moe_|gemv_|row_sumsq|rms_apply|gdn_|gattn_|argmax|topk|attn_|splitk_|kv_norm|qk_norm|add_rmsnorm|silu_mul)'
  timeout $LEFT ncu --clock-control none --metrics gpu__time_duration.sum --csv --kernel-name "$OURS" \
    -c 2600 /tmp/b/dflash-serve bench --model qwen3.6-27b --e2e-only --prefill 64 --e2e-prompt 64 \
    --e2e-tokens 8 --budgets 16 --no-e2e-check > /tmp/h27.csv 2>$OUT/l/h27-ncu.err
  echo "h27 ncu rc=$? at $(el) s"
  python3 deploy/bench/next/ncu_mean.py /tmp/h27.csv > $OUT/l/h27_kernels.txt; head -30 $OUT/l/h27_kernels.txt
  xz -9 -c /tmp/h27.csv > $OUT/l/h27_ncu.csv.xz
fi
# Few files come back from a call (8 in session 26): one archive.
tar -C $OUT -cJf $OUT/l.tar.xz l && rm -rf $OUT/l
echo "done at $(el) s"
