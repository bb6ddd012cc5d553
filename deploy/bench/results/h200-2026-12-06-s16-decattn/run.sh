#!/usr/bin/env bash
# s16-decattn: the batched one-token step attention (attn_step.cu) against the old default
# (base_512), alone and inside the B16/32/64 decode graph steps, in one call.
mkdir -p /tmp/b && tar -xJf .gpu-s16-decattn/bundle.tar.xz -C /tmp/b && . /tmp/b/env.sh
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv > $OUT/gpu.txt 2>&1
cat $OUT/gpu.txt
start=$(date +%s)
export GPU_CHECK_ATTN_VARIANTS=base_512,step3_auto,step2_auto
timeout 200 /tmp/b/gpu_check cuda $OUT/attn.json --scale --attn-only > $OUT/attn.log 2>&1
rc=$?
echo "gpu_check rc $rc after $(( $(date +%s) - start )) s"
if [ ! -s $OUT/attn.json ]; then
  echo "no report: rerun with the step kernel alone, blocking launches"
  GPU_CHECK_ATTN_VARIANTS=base_512,step3_auto CUDA_LAUNCH_BLOCKING=1 timeout 30 \
    /tmp/b/gpu_check cuda $OUT/attn2.json --scale --attn-only > $OUT/attn2.log 2>&1
  echo "rerun rc $?"; tail -20 $OUT/attn2.log
fi
grep -E "FAIL|copy bandwidth|batch attn|decode b|decode_graph|wrong|Error|error" $OUT/attn.log | head -150
tail -5 $OUT/attn.log
