#!/usr/bin/env bash
# Session 19, device call D (issue 20): the hybrid MoE (Qwen3.6-35B-A3B shape) with its sparse
# blocks on the device (routed experts through cuda::moe_block, the shared expert beside them)
# on the fused decode/verify path and in the plain path's trees; then the 27B DDTree-64 with the
# phase profile of a third request (the warm request's verify was 2x the first's).
set -u
D=.gpu-s19d
mkdir -p /tmp/b && tar -xJf $D/bundle.tar.xz -C /tmp/b && . /tmp/b/env.sh
T0=$(date +%s); el() { echo $(( $(date +%s) - T0 )); }
mkdir -p $OUT/w
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee $OUT/w/gpu.txt
timeout 200 /tmp/b/dflash-serve bench --model qwen3.6-35b-a3b --e2e-prompt 1024 --e2e-tokens 128 \
  --budgets 16,64 --out $OUT/w/h35.json > $OUT/w/h35.log 2>&1
echo "bench 35b-a3b rc=$? at $(el) s"; grep -E "^kernel_checks|error|panick" $OUT/w/h35.log | head -4 | cut -c1-600
python3 - $OUT/w/h35.json <<'PY'
import json,sys
d=json.load(open(sys.argv[1]))
print("decode", d.get("decode_through_engine"))
for k,v in d.get("e2e",{}).items():
    if isinstance(v,dict) and "engine" in v: print(k, round(v.get("tok_per_s",0),1), v.get("speedup_vs_plain"), "verify", v["engine"].get("verify_ms_per_round"), "warm", v["engine"].get("warm",{}).get("verify_ms_per_round"))
PY
left=$(( 560 - $(el) )); if [ $left -gt 90 ]; then
  timeout $left /tmp/b/dflash-serve bench --model qwen3.6-27b --e2e-prompt 1024 --e2e-tokens 128 \
    --budgets 64 --e2e-profile --out $OUT/w/h27p.json > $OUT/w/h27p.log 2>&1
  echo "bench 27b profile rc=$? at $(el) s"
fi
tar -C $OUT -cJf $OUT/s19d.tar.xz w && rm -rf $OUT/w
echo "done at $(el) s"
