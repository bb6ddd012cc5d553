#!/usr/bin/env bash
# Issue 20: the second form of the chunked delta rule (bf16 operands, cp.async double buffering,
# 64-column scan blocks, a two-per-SM solve): gpu_check --gdn-chunk (errors against the scan,
# ms), its kernels under ncu (time, throughputs, occupancy), the 27B prefill 4K with the chunked
# form on and off (like for like, one warm machine), then ncu of the 12-layer 35B-A3B decode
# past the random-weight kernels (--launch-skip). Also the wide MoE routing (prefills: tiles
# of <= 64 pairs per expert instead of the host-routed plain block past 512 rows): gpu_check
# --moe (block checks at 1..1000 rows, 4-layer Coder bench) and the 12-layer 35B-A3B's 1K
# prefill.
set -u
D=${D:-.gpu-serve}
mkdir -p /tmp/b && tar -xJf $D/bundle.tar.xz -C /tmp/b && . /tmp/b/env.sh
T0=$(date +%s); el() { echo $(( $(date +%s) - T0 )); }
mkdir -p $OUT/h
/tmp/b/gpu_check cuda $OUT/h/gdn.json --gdn-chunk 2>&1 | tail -2 | cut -c1-1500
timeout 150 /tmp/b/gpu_check cuda $OUT/h/moe.json --moe --moe-layers=4 > $OUT/h/moe.log 2>&1
echo "moe rc=$? at $(el) s"; grep -o '"pass":[a-z]*' $OUT/h/moe.log | sort | uniq -c
python3 -c "import json,sys; d=json.load(open(sys.argv[1])); b=d['moe_block']; print({k: v for k, v in b.get('rows_1000', {}).items()}); print('pass', b.get('pass'))" $OUT/h/moe.json
DFLASH_GDN_CHUNKED=1 timeout 60 /tmp/b/dflash-serve bench --model deploy/bench/next/qwen3.6-35b-a3b-12-layers.json \
  --prefill 1024 --e2e-prompt 1024 --e2e-tokens 32 --budgets 16 --no-e2e-check --out $OUT/h/h35-12.json > $OUT/h/h35-12.log 2>&1
echo "35b-12 rc=$? at $(el) s"
python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print({k: d[k] for k in d if k.startswith(('prefill_', 'decode_'))})" $OUT/h/h35-12.json | cut -c1-1500
M=gpu__time_duration.sum,sm__throughput.avg.pct_of_peak_sustained_elapsed,dram__throughput.avg.pct_of_peak_sustained_elapsed,sm__warps_active.avg.pct_of_peak_sustained_active,dram__bytes_read.sum,dram__bytes_write.sum,lts__t_bytes.sum,smsp__inst_executed.sum,sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_elapsed,launch__grid_size,launch__registers_per_thread,l1tex__data_bank_conflicts_pipe_lsu_mem_shared.sum
timeout 120 ncu --clock-control none --metrics $M --csv -k regex:gdn_ /tmp/b/gpu_check cuda /tmp/x.json --gdn-chunk > $OUT/h/gdn_ncu.csv 2> $OUT/h/gdn_ncu.err
echo "gdn ncu rc=$? at $(el) s"
python3 - $OUT/h/gdn_ncu.csv <<'PY'
import csv, sys, collections
rows = [r for r in csv.reader(open(sys.argv[1])) if len(r) > 10]
hdr = rows[0]; ki = hdr.index("Kernel Name"); mi = hdr.index("Metric Name"); vi = hdr.index("Metric Value"); ii = hdr.index("ID")
by = collections.OrderedDict()
for r in rows[1:]:
    by.setdefault((r[ii], r[ki][:40]), {})[r[mi]] = r[vi]
for (i, k), m in by.items():
    print(i, k, " ".join(f"{a.split('.')[0].split('__')[-1]}={b}" for a, b in m.items()))
PY
for ch in 1 0; do
  DFLASH_GDN_CHUNKED=$ch timeout 150 /tmp/b/dflash-serve bench --model qwen3.6-27b --prefill 4096 --e2e-prompt 1024 \
    --e2e-tokens 32 --budgets 16 --no-e2e-check --out $OUT/h/h27-chunked$ch.json > $OUT/h/h27-chunked$ch.log 2>&1
  echo "27b chunked=$ch rc=$? at $(el) s"
  python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print({k: d[k] for k in d if k.startswith('prefill_') and not k.endswith('phases')}); print({a: round(b['ms'],1) for a,b in d['prefill_4096_phases']['phases'].items()}); print({k: v for k, v in d.get('kernel_checks', {}).items() if k.startswith('gdn')})" $OUT/h/h27-chunked$ch.json
done
timeout $(( 560 - $(el) )) ncu --clock-control none --metrics gpu__time_duration.sum --csv --launch-skip 3300 -c 4000 \
  /tmp/b/dflash-serve bench --model deploy/bench/next/qwen3.6-35b-a3b-12-layers.json --e2e-only \
  --prefill 64 --e2e-prompt 64 --e2e-tokens 16 --budgets 16 --no-e2e-check --out /tmp/h35n.json > /tmp/h35.csv 2>$OUT/h/h35-ncu.err
echo "h35 ncu rc=$? at $(el) s"
python3 deploy/bench/next/ncu_mean.py /tmp/h35.csv > $OUT/h/h35_kernels.txt; head -45 $OUT/h/h35_kernels.txt
xz -9 -c /tmp/h35.csv > $OUT/h/h35_ncu.csv.xz
tar -C $OUT -cJf $OUT/gdn-profile.tar.xz h && rm -rf $OUT/h
echo "done at $(el) s"
