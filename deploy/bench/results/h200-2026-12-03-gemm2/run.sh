#!/usr/bin/env bash
# The one device call of this session (issue 17, attempt 2 at the 17..64-row GEMMs), run from
# the session's checkout with the bundle and this script carried in .gpu-gemm/: gpu_check
# --scale --gemm-only (GEMM checks: cuBLASLt heuristic / tuned and the split-K kernels against
# cuBLAS; per-GEMM timings at 16..64 rows; what the tuner measured; decode steps b16/32/64 at
# 640 positions with each GEMM option in CUDA graphs). If it fails, a rerun without the
# split-K kernels keeps the other figures.
set -u
mkdir -p /tmp/b && tar -xJf .gpu-gemm/bundle.tar.xz -C /tmp/b && . /tmp/b/env.sh
T0=$(date +%s); el() { echo $(( $(date +%s) - T0 )); }
nvidia-smi --query-gpu=name,clocks.max.sm,memory.total --format=csv,noheader
( cd /tmp/b && timeout 150 ./gpu_check cuda $OUT/gemm.json --scale --gemm-only > $OUT/gemm.log 2>&1; echo "gpu_check rc=$? at $(el) s" )
if ! grep -q "scale done" $OUT/gemm.log; then
  tail -n 5 $OUT/gemm.log | cut -c1-300
  ( cd /tmp/b && GPU_CHECK_NO_SPLITK=1 timeout $(( 225 - $(el) )) ./gpu_check cuda $OUT/gemm-nosplitk.json --scale --gemm-only > $OUT/gemm-nosplitk.log 2>&1; echo "gpu_check (no splitk) rc=$? at $(el) s" )
  L=$OUT/gemm-nosplitk.log
else
  L=$OUT/gemm.log
fi
grep -E "^scale (copy|gemm|tuner|decode|done|checks)" $L | cut -c1-330
echo "== worst rel err per kernel family (excluding wrong_weights / repeat / row_independent)"
for fam in lt_heuristic lt_heuristic_resid lt_tuned lt_tuned_resid splitk_store splitk_resid splitk_silu gemv_store gemv_silu gemv_resid; do
  grep -E "^scale $fam:" $L | grep -vE "wrong_weights|repeat|row_independent" | awk -v f=$fam '{print $NF, $2}' | sort -g | tail -1 | sed "s/^/$fam worst: /"
done
echo "== wrong_weights (must be large):"; grep -E "wrong_weights" $L | cut -c1-120
echo "== repeat / row_independent not 0:"; grep -E "splitk.*(repeat|row_independent)" $L | grep -v "rel err 0.000e0" | head -6
echo "== count splitk checks:"; grep -cE "^scale splitk" $L
echo "done at $(el) s"
