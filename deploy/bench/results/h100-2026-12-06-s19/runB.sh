#!/usr/bin/env bash
# Session 19, device call B (issue 20): gpu_check --hybrid (split prefill, tree kernels vs the plain
# tree form), the Qwen3.6-27B bench with the default tree path and with DFLASH_GDN_TREE_KERNEL=1.
set -u
D=.gpu-s19a
mkdir -p /tmp/b && tar -xJf $D/bundle.tar.xz -C /tmp/b && . /tmp/b/env.sh
T0=$(date +%s); el() { echo $(( $(date +%s) - T0 )); }
mkdir -p $OUT/y
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee $OUT/y/gpu.txt
( cd /tmp/b && timeout 200 ./gpu_check cuda $OUT/y/hybrid.json --hybrid > $OUT/y/hybrid.log 2>&1; echo "gpu_check --hybrid rc=$? at $(el) s" )
grep -iE "tree|prefill_t|error|panick|fail" $OUT/y/hybrid.log | tail -24 | cut -c1-220
for k in 0 1; do
  left=$(( 590 - $(el) )); [ $left -gt 60 ] || break
  DFLASH_GDN_TREE_KERNEL=$k timeout $left /tmp/b/dflash-serve bench --model qwen3.6-27b --e2e-prompt 1024 --e2e-tokens 128 \
    --budgets 16,64 --out $OUT/y/h27-tk$k.json > $OUT/y/h27-tk$k.log 2>&1
  echo "bench 27b tree_kernel=$k rc=$? at $(el) s"; grep -iE "tree|verify|e2e|decode" $OUT/y/h27-tk$k.log | tail -n 14 | cut -c1-200
done
tar -C $OUT -cJf $OUT/s19b.tar.xz y && rm -rf $OUT/y
echo "done at $(el) s"
