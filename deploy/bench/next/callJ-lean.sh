#!/usr/bin/env bash
# Issue 20, one lean call (little device time left in session 25): the chunked delta rule's
# second form checked (gpu_check --gdn-chunk), the 27B prefill 4K with it on and off, the full
# Qwen3.6-35B-A3B shape (decode through the engine, e2e, prefill 4K with the wide MoE routing)
# and the full Qwen3-Coder-30B-A3B bench (gpu_check --moe, 48 layers). Each step only when
# time is left (LIMIT seconds in all).
set -u
D=${D:-.gpu-serve}
mkdir -p /tmp/b && tar -xJf $D/bundle.tar.xz -C /tmp/b && . /tmp/b/env.sh
T0=$(date +%s); el() { echo $(( $(date +%s) - T0 )); }
LIMIT=${LIMIT:-150}
left() { echo $(( LIMIT - $(el) )); }
mkdir -p $OUT/j
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/j/gpu.txt
timeout 40 /tmp/b/gpu_check cuda $OUT/j/gdn.json --gdn-chunk 2>&1 | tail -1 | cut -c1-1500
summ() {
python3 - "$1" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
print({k: d[k] for k in d if k.startswith(("prefill_", "decode_")) and not k.endswith("phases")})
for k in d:
    if k.endswith("phases"): print({a: round(b["ms"], 1) for a, b in d[k]["phases"].items()})
print({k: v.get("pass", v) for k, v in d.get("kernel_checks", {}).items() if k.startswith("gdn")})
e = d.get("e2e", {})
print("e2e", {k: (e[k].get("speedup_vs_plain"), e[k].get("warm_speedup_vs_plain")) for k in ("chain", "ddtree_16") if k in e})
PY
}
for ch in 1; do
  [ $(left) -gt 60 ] || break
  DFLASH_GDN_CHUNKED=$ch timeout $(left) /tmp/b/dflash-serve bench --model qwen3.6-27b --prefill 4096 --e2e-prompt 1024 \
    --e2e-tokens 32 --budgets 16 --no-e2e-check --out $OUT/j/h27-chunked$ch.json > $OUT/j/h27-chunked$ch.log 2>&1
  echo "27b chunked=$ch rc=$? at $(el) s"; summ $OUT/j/h27-chunked$ch.json 2>&1 | cut -c1-1200
done
if [ $(left) -gt 70 ]; then
  DFLASH_GDN_CHUNKED=1 timeout $(left) /tmp/b/dflash-serve bench --model qwen3.6-35b-a3b --prefill 4096 --e2e-prompt 1024 \
    --e2e-tokens 32 --budgets 16 --no-e2e-check --out $OUT/j/h35-full.json > $OUT/j/h35-full.log 2>&1
  echo "35b-a3b full rc=$? at $(el) s"; grep -m1 -i "error" $OUT/j/h35-full.log | cut -c1-300; summ $OUT/j/h35-full.json 2>&1 | cut -c1-1500
fi
if [ $(left) -gt 40 ]; then
  timeout $(left) /tmp/b/gpu_check cuda $OUT/j/moe48.json --moe > $OUT/j/moe48.log 2>&1
  echo "coder full rc=$? at $(el) s"
  python3 -c "import json,sys; d=json.load(open(sys.argv[1])); b=d.get('qwen3_coder_30b_a3b_shape_bench', {}); print({k: b[k] for k in ('decode_1', 'verify_chain_16', 'chain16_over_decode', 'prefill_1k_ms') if k in b}); print('block pass', d['moe_block'].get('pass'))" $OUT/j/moe48.json 2>&1 | cut -c1-1500
fi
tar -C $OUT -cJf $OUT/lean.tar.xz j && rm -rf $OUT/j
echo "done at $(el) s"
