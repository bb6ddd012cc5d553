#!/usr/bin/env bash
# Issue 20, after callH: the chunked delta rule's second form with its launch constants fixed
# (64-column scan blocks, the solve's smaller shared memory), checked and profiled; the 27B
# prefill 4K with it on and off; the 12-layer 35B-A3B with the wide MoE routing (prefill 1K,
# e2e); ncu of the 35B-A3B decode past the random-weight kernels. And programmatic dependent
# launch of the one-row GEMMs (DFLASH_PDL=1, off by default): the 27B's decode and e2e, the
# dense Qwen3-8B's decode, with it off and on (kernel checks and e2e token checks with it on).
set -u
D=${D:-.gpu-serve}
mkdir -p /tmp/b && tar -xJf $D/bundle.tar.xz -C /tmp/b && . /tmp/b/env.sh
T0=$(date +%s); el() { echo $(( $(date +%s) - T0 )); }
mkdir -p $OUT/i
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/i/gpu.txt
/tmp/b/gpu_check cuda $OUT/i/gdn.json --gdn-chunk 2>&1 | tail -1 | cut -c1-1500
for ch in 1 0; do
  DFLASH_GDN_CHUNKED=$ch timeout 150 /tmp/b/dflash-serve bench --model qwen3.6-27b --prefill 4096 --e2e-prompt 1024 \
    --e2e-tokens 64 --budgets 16 --no-e2e-check --out $OUT/i/h27-chunked$ch.json > $OUT/i/h27-chunked$ch.log 2>&1
  echo "27b chunked=$ch rc=$? at $(el) s"
  python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print({k: d[k] for k in d if k.startswith(('prefill_', 'decode_')) and not k.endswith('phases')}); print({a: round(b['ms'],1) for a,b in d['prefill_4096_phases']['phases'].items()}); print({k: v for k, v in d.get('kernel_checks', {}).items() if k.startswith('gdn')}); e=d['e2e']; print('e2e', {k: (e[k].get('speedup_vs_plain'), e[k].get('warm_speedup_vs_plain')) for k in ('chain', 'ddtree_16') if k in e})" $OUT/i/h27-chunked$ch.json
done
for ch in 1 0; do
  DFLASH_GDN_CHUNKED=$ch timeout 60 /tmp/b/dflash-serve bench --model deploy/bench/next/qwen3.6-35b-a3b-12-layers.json \
    --prefill 1024 --e2e-prompt 1024 --e2e-tokens 32 --budgets 16 --no-e2e-check --out $OUT/i/h35-12-chunked$ch.json > $OUT/i/h35-12-chunked$ch.log 2>&1
  rc=$?; echo "35b-12 chunked=$ch rc=$rc at $(el) s"; grep -m1 -i "error" $OUT/i/h35-12-chunked$ch.log | cut -c1-300
  python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print({k: d[k] for k in d if k.startswith(('prefill_', 'decode_')) and not k.endswith('phases')}); print({a: round(b['ms'],1) for a,b in d['prefill_1024_phases']['phases'].items()}); print({k: v for k, v in d.get('kernel_checks', {}).items() if not k.startswith(('gdn', 'attention'))}); e=d['e2e']; print('e2e', {k: (e[k].get('speedup_vs_plain'), e[k].get('warm_speedup_vs_plain')) for k in ('chain', 'ddtree_16') if k in e})" $OUT/i/h35-12-chunked$ch.json 2>&1 | cut -c1-1200
  [ $rc = 0 ] && break
done
# The full shapes (the Done-when's): Qwen3.6-35B-A3B (40 layers, 70 GB) and Qwen3-Coder-30B-A3B
# (48 layers, gpu_check --moe's bench).
DFLASH_GDN_CHUNKED=1 timeout 150 /tmp/b/dflash-serve bench --model qwen3.6-35b-a3b --prefill 4096 --e2e-prompt 1024 \
  --e2e-tokens 64 --budgets 16 --no-e2e-check --out $OUT/i/h35-full.json > $OUT/i/h35-full.log 2>&1
echo "35b-a3b full rc=$? at $(el) s"; grep -m1 -i "error" $OUT/i/h35-full.log | cut -c1-300
python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print({k: d[k] for k in d if k.startswith(('prefill_', 'decode_')) and not k.endswith('phases')}); e=d['e2e']; print('e2e', {k: (e[k].get('speedup_vs_plain'), e[k].get('warm_speedup_vs_plain')) for k in ('chain', 'ddtree_16') if k in e})" $OUT/i/h35-full.json 2>&1 | cut -c1-1500
timeout 150 /tmp/b/gpu_check cuda $OUT/i/moe48.json --moe > $OUT/i/moe48.log 2>&1
echo "coder full rc=$? at $(el) s"
python3 -c "import json,sys; d=json.load(open(sys.argv[1])); b=d['qwen3_coder_30b_a3b_shape_bench']; print({k: b[k] for k in ('decode_1', 'verify_chain_16', 'chain16_over_decode', 'prefill_1k_ms') if k in b}); print('block pass', d['moe_block'].get('pass'))" $OUT/i/moe48.json 2>&1 | cut -c1-1500
M=gpu__time_duration.sum,sm__warps_active.avg.pct_of_peak_sustained_active,dram__throughput.avg.pct_of_peak_sustained_elapsed,sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_elapsed,launch__grid_size
timeout 90 ncu --clock-control none --metrics $M --csv -k regex:gdn_chunk /tmp/b/gpu_check cuda /tmp/x.json --gdn-chunk > $OUT/i/gdn_ncu.csv 2> $OUT/i/gdn_ncu.err
echo "gdn ncu rc=$? at $(el) s"
python3 - $OUT/i/gdn_ncu.csv <<'PY'
import csv, sys, collections
rows = list(csv.reader(open(sys.argv[1])))
i0 = [i for i, r in enumerate(rows) if r and r[0] == "ID"][0]
hdr = rows[i0]; rows = [r for r in rows[i0 + 1:] if len(r) == len(hdr)]
ki, mi, vi, ii = (hdr.index(x) for x in ("Kernel Name", "Metric Name", "Metric Value", "ID"))
by = collections.OrderedDict()
for r in rows:
    by.setdefault((r[ii], r[ki][:20]), {})[r[mi]] = r[vi]
for (i, k), m in by.items():
    print(i, k, " ".join(f"{a.split('.')[0].split('__')[-1][:12]}={b}" for a, b in m.items()))
PY
for pdl in 0 1; do
  [ $(( 560 - $(el) )) -gt 80 ] || break
  DFLASH_PDL=$pdl timeout 70 /tmp/b/dflash-serve bench --model qwen3-8b --variants fast --contexts 1024 --batch-sizes \
    --sizes 1,16 --budgets 16 --e2e-tokens 64 --out $OUT/i/q8-pdl$pdl.json > $OUT/i/q8-pdl$pdl.log 2>&1
  echo "qwen3-8b pdl=$pdl rc=$? at $(el) s"
  python3 -c "import json,sys; d=json.load(open(sys.argv[1])); f=d['variants']['fast']; print('decode', json.dumps(f.get('decode'))[:600]); print('e2e', json.dumps(f.get('e2e'))[:700]); print('checks', json.dumps(d.get('kernel_checks'))[:700])" $OUT/i/q8-pdl$pdl.json 2>&1 | cut -c1-2200
done
if [ $(( 560 - $(el) )) -gt 60 ]; then
  DFLASH_PDL=1 timeout 60 /tmp/b/dflash-serve bench --model qwen3.6-27b --prefill 1024 --e2e-prompt 1024 \
    --e2e-tokens 64 --budgets 16 --out $OUT/i/h27-pdl1.json > $OUT/i/h27-pdl1.log 2>&1
  echo "27b pdl=1 rc=$? at $(el) s"
  python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print({k: d[k] for k in d if k.startswith(('decode_', 'e2e_step'))}); print({k: v for k, v in d.get('kernel_checks', {}).items() if not k.startswith('gdn')}); e=d['e2e']; print('e2e', {k: (e[k].get('speedup_vs_plain'), e[k].get('warm_speedup_vs_plain')) for k in ('chain', 'ddtree_16') if k in e})" $OUT/i/h27-pdl1.json 2>&1 | cut -c1-1500
fi
LEFT=$(( 540 - $(el) ))
[ $LEFT -gt 60 ] && timeout $LEFT ncu --clock-control none --metrics gpu__time_duration.sum --csv --launch-skip 4600 -c 2500 \
  /tmp/b/dflash-serve bench --model deploy/bench/next/qwen3.6-35b-a3b-12-layers.json --e2e-only \
  --prefill 64 --e2e-prompt 64 --e2e-tokens 16 --budgets 16 --no-e2e-check --out /tmp/h35n.json > /tmp/h35.csv 2>$OUT/i/h35-ncu.err
echo "h35 ncu rc=$? at $(el) s"
python3 deploy/bench/next/ncu_mean.py /tmp/h35.csv > $OUT/i/h35_kernels.txt; head -40 $OUT/i/h35_kernels.txt
xz -9 -c /tmp/h35.csv > $OUT/i/h35_ncu.csv.xz
tar -C $OUT -cJf $OUT/gdn-moe.tar.xz i && rm -rf $OUT/i
echo "done at $(el) s"
