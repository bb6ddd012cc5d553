#!/usr/bin/env bash
# The one device call of this session (issue 17, batched decode attention), run from the
# session's checkout with the bundle and this script carried in .gpu-attn/: gpu_check --scale
# --attn-only (the batched decode attention's kernel variants x target blocks checked against
# one launch per sequence and timed alone at B 16/32/64, ctx 640/4096; decode steps
# b16/32/64 at 640 positions with each variant in CUDA graphs, roofline fractions). If it
# fails, a rerun with the base and 3-block variants only keeps the other figures.
set -u
mkdir -p /tmp/b && tar -xJf .gpu-attn/bundle.tar.xz -C /tmp/b && . /tmp/b/env.sh
T0=$(date +%s); el() { echo $(( $(date +%s) - T0 )); }
nvidia-smi --query-gpu=name,clocks.max.sm,memory.total --format=csv,noheader
( cd /tmp/b && timeout 130 ./gpu_check cuda $OUT/attn.json --scale --attn-only > $OUT/attn.log 2>&1; echo "gpu_check rc=$? at $(el) s" )
L=$OUT/attn.log
if ! grep -q "scale decode b64 ctx640 graph b4s1_4096" $L; then
  tail -n 6 $L | cut -c1-300
  ( cd /tmp/b && GPU_CHECK_ATTN_VARIANTS=base_1024,base_512,base_2048,b3_1024,b3_2048 timeout $(( 185 - $(el) )) ./gpu_check cuda $OUT/attn-b3.json --scale --attn-only > $OUT/attn-b3.log 2>&1; echo "gpu_check (base, b3) rc=$? at $(el) s" )
  L=$OUT/attn-b3.log
fi
grep -E "^scale (copy|batch attn|decode)" $L | cut -c1-200
echo "== worst rel err per variant (vs one launch per sequence):"
grep -E "^scale batch_attn:" $L | grep -vE "repeat|wrong" | awk '{split($2,a,":"); print $NF, a[3]}' | sort -k2,2 -k1,1g | awk '{w[$2]=$1} END {for (k in w) print k, w[k]}'
echo "== wrong_sequence (must be large):"; grep -E "wrong_sequence" $L
echo "== repeat not 0 / FAIL:"; grep -E "repeat" $L | grep -v "rel err 0.000e0" | head; grep -c FAIL $L
echo "done at $(el) s"
