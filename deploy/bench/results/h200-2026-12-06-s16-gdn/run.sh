#!/usr/bin/env bash
# s16-gdn (issue 20): gpu_check --hybrid with the split GDN kernels (gdn_split.cu), every fused
# GDN path (chain / split+states / split+inputs) timed, profiled and checked in the same call.
D=.gpu-s16-gdn
mkdir -p /tmp/b && tar -xJf $D/bundle.tar.xz -C /tmp/b && . /tmp/b/env.sh
export DFLASH_TESTS_DIR=$PWD/tests
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader
T0=$(date +%s)
timeout 200 /tmp/b/gpu_check cuda $OUT/hybrid.json --hybrid > $OUT/hybrid.log 2>&1; echo "rc=$? after $(( $(date +%s) - T0 )) s"
grep -E '^hybrid GDN layer paths' $OUT/hybrid.log | cut -c1-1500
grep -E 'error|panick|Error' $OUT/hybrid.log | cut -c1-400 | head -8
python3 - <<'PY'
import json, os
d = json.load(open(os.environ["OUT"] + "/hybrid.json"))
b = d.get("qwen3_6_27b_shape_bf16", {})
for k in ["decode_1", "verify_chain_16"]:
    print(k, b.get(k))
p = b.get("gdn_paths_whole_model", {})
for name in ["chain", "split_states", "split_inputs"]:
    x = p.get(name, {})
    print(name, {k: x.get(k) for k in ["decode_fraction_of_roofline", "verify_16_over_decode", "verify_16_over_decode_with_commits"]},
          "decode", x.get("decode_1", {}).get("ms"), x.get("decode_1", {}).get("with_commit_ms"),
          "verify", x.get("verify_chain_16", {}).get("ms"), x.get("verify_chain_16", {}).get("with_commit_ms"))
    print("  vs_plain", json.dumps(x.get("vs_plain"))[:600])
if "error" in p: print("paths error", p["error"])
PY
