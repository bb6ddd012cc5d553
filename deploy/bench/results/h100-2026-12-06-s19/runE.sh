#!/usr/bin/env bash
# Session 19, device call E (issue 20): gpu_check --moe with the hybrid sparse block case
# (MoeKernels::apply against the plain block at the 35B-A3B block shape), then gpu_check --hybrid
# for the prefill cases' new f32 reference.
set -u
D=.gpu-s19e
mkdir -p /tmp/b && tar -xJf $D/bundle.tar.xz -C /tmp/b && . /tmp/b/env.sh
T0=$(date +%s); el() { echo $(( $(date +%s) - T0 )); }
mkdir -p $OUT/v
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee $OUT/v/gpu.txt
( cd /tmp/b && timeout 90 ./gpu_check cuda $OUT/v/moe.json --moe --moe-layers=8 > $OUT/v/moe.log 2>&1; echo "gpu_check --moe rc=$? at $(el) s" )
grep -E "^moe hybrid block" $OUT/v/moe.log | cut -c1-2500
( cd /tmp/b && timeout 45 ./gpu_check cuda $OUT/v/hybrid.json --hybrid > $OUT/v/hybrid.log 2>&1; echo "gpu_check --hybrid rc=$? at $(el) s" )
grep "GDN layer paths" $OUT/v/hybrid.log | python3 -c '
import json,sys
l=sys.stdin.read(); d=json.loads(l[l.index("{"):])
for k in ("prefill_t100","prefill_t1000","gdn_tree_16","gdn_tree_64","pass"):
    v=d.get(k); print(k, v if not isinstance(v,dict) else {a:b for a,b in v.items() if a in ("pass","y_rel_err","vs_f32_reference")})' 2>&1 | cut -c1-400
tar -C $OUT -cJf $OUT/s19e.tar.xz v && rm -rf $OUT/v
echo "done at $(el) s"
