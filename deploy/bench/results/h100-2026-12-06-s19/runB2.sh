#!/usr/bin/env bash
# Session 19, device call B2 (issue 20): gpu_check --hybrid with the star-shaped wrong case
# (split prefill and tree-kernel cases), the Qwen3.6-27B bench with the tree kernels on by default
# (a warning names any verify tree they decline), and the 35B-A3B hybrid MoE bench.
set -u
D=.gpu-s19b
mkdir -p /tmp/b && tar -xJf $D/bundle.tar.xz -C /tmp/b && . /tmp/b/env.sh
T0=$(date +%s); el() { echo $(( $(date +%s) - T0 )); }
mkdir -p $OUT/y
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee $OUT/y/gpu.txt
( cd /tmp/b && timeout 200 ./gpu_check cuda $OUT/y/hybrid.json --hybrid > $OUT/y/hybrid.log 2>&1; echo "gpu_check --hybrid rc=$? at $(el) s" )
grep "GDN layer paths" $OUT/y/hybrid.log | python3 -c '
import json,sys
l=sys.stdin.read(); d=json.loads(l[l.index("{"):])
for k,v in d.items():
    if isinstance(v,dict): print(k, {a:b for a,b in v.items() if not isinstance(b,dict) or a=="call_ms"})
    else: print(k,v)' 2>&1 | cut -c1-400
export RUST_LOG=warn
timeout 200 /tmp/b/dflash-serve bench --model qwen3.6-27b --e2e-prompt 1024 --e2e-tokens 128 \
  --budgets 16,64 --out $OUT/y/h27.json > $OUT/y/h27.log 2>&1
echo "bench 27b rc=$? at $(el) s"; grep -iE "warn|declined" $OUT/y/h27.log | head -5 | cut -c1-300
left=$(( 585 - $(el) )); if [ $left -gt 60 ]; then
  timeout $left /tmp/b/dflash-serve bench --model qwen3.6-35b-a3b --e2e-prompt 1024 --e2e-tokens 128 \
    --budgets 16,64 --out $OUT/y/h35.json > $OUT/y/h35.log 2>&1
  echo "bench 35b-a3b rc=$? at $(el) s"; grep -iE "warn|declined|error" $OUT/y/h35.log | head -5 | cut -c1-300
fi
tar -C $OUT -cJf $OUT/s19b2.tar.xz y && rm -rf $OUT/y
echo "done at $(el) s"
