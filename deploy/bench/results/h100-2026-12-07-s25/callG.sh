#!/usr/bin/env bash
# Issue 20 (bundle: dflash-serve + gpu_check, built with gdn_chunk.cu):
#   1. The Qwen3.6-27B shape with the chunked delta rule on (DFLASH_GDN_CHUNKED=1): kernel_checks
#      (gdn_chunked:* against the scan: gated-norm output and last state, 27B heads at 1,000 and
#      4,396 tokens, 35B-A3B heads at 1,000; with ms of each), prefill 4K with its phases
#      (gdn.scan was 125 ms of 0.60 s with the scan), e2e plain/chain (tokens checked).
#   2. The 12-layer Qwen3.6-35B-A3B shape's prefill 1K with the chunked form (--e2e-only off).
#   3. ncu of the 12-layer 35B-A3B decode (shared expert in the block, decode graphs on: the
#      defaults), our kernels and cuBLAS's, per-kernel means (ncu_mean.py).
set -u
D=${D:-.gpu-serve}
mkdir -p /tmp/b && tar -xJf $D/bundle.tar.xz -C /tmp/b && . /tmp/b/env.sh
T0=$(date +%s); el() { echo $(( $(date +%s) - T0 )); }
LIMIT=${LIMIT:-560}
left() { echo $(( LIMIT - $(el) > 10 ? LIMIT - $(el) : 10 )); }
mkdir -p $OUT/g
export RUST_LOG=warn
show() {
python3 - "$1" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
for k, v in d.items():
    if k.startswith(("decode_", "prefill_", "e2e_step_graph_check")):
        print(k, json.dumps(v)[:700])
for k, v in d.get("kernel_checks", {}).items():
    print("check", k, json.dumps(v))
e = d.get("e2e", {})
for k in ("chain", "ddtree_16"):
    if k in e:
        print("e2e", k, e[k].get("speedup_vs_plain"), e[k].get("warm_speedup_vs_plain"))
PY
}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee $OUT/g/gpu.txt
DFLASH_GDN_CHUNKED=1 timeout $(left) /tmp/b/dflash-serve bench --model qwen3.6-27b --prefill 4096 --e2e-prompt 1024 \
  --e2e-tokens 64 --budgets 16 --out $OUT/g/h27-chunked.json > $OUT/g/h27-chunked.log 2>&1
echo "bench 27b chunked rc=$? at $(el) s"; show $OUT/g/h27-chunked.json; tail -3 $OUT/g/h27-chunked.log | cut -c1-400
DFLASH_GDN_CHUNKED=1 timeout $(left) /tmp/b/dflash-serve bench --model deploy/bench/next/qwen3.6-35b-a3b-12-layers.json \
  --prefill 1024 --e2e-only --no-e2e-check --e2e-prompt 1024 --e2e-tokens 32 --budgets 16 --out $OUT/g/h35-12-chunked.json > $OUT/g/h35-12-chunked.log 2>&1
echo "bench 35b-a3b 12 layers chunked rc=$? at $(el) s"; show $OUT/g/h35-12-chunked.json
# ncu prints its table only at the end: skip it when too little of the call is left.
[ "$(left)" -gt 150 ] && timeout $(( $(left) - 20 )) ncu --clock-control none --metrics gpu__time_duration.sum --csv -c 3000 \
  /tmp/b/dflash-serve bench --model deploy/bench/next/qwen3.6-35b-a3b-12-layers.json --e2e-only \
  --prefill 64 --e2e-prompt 64 --e2e-tokens 16 --budgets 16 --no-e2e-check --out /tmp/h35n.json > /tmp/h35.csv 2>$OUT/g/h35-ncu.err
echo "h35 ncu rc=$? at $(el) s"; tail -2 $OUT/g/h35-ncu.err | cut -c1-300
python3 deploy/bench/next/ncu_mean.py /tmp/h35.csv > $OUT/g/h35_kernels.txt; head -50 $OUT/g/h35_kernels.txt
xz -9 -c /tmp/h35.csv > $OUT/g/h35_ncu.csv.xz
tar -C $OUT -cJf $OUT/gdn-chunk.tar.xz g && rm -rf $OUT/g
echo "done at $(el) s"
