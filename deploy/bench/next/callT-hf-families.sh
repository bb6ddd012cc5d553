#!/usr/bin/env bash
# Issue 20's HF transformers baseline at the family shapes (random bf16 weights, built in bf16:
# session 18's f32 build of the 27B ran out of memory), beside `dflash-serve bench` of the same
# shapes: decode at 1K, a 4096-token prefill, and for the Coder the chain forwards over a 1K
# cache. No bundle needed (PyTorch + transformers of the machine). ~60-120 s a family.
set -u
T0=$(date +%s); el() { echo $(( $(date +%s) - T0 )); }
mkdir -p $OUT/t
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee $OUT/t/gpu.txt
for m in ${MODELS:-qwen3-coder-30b-a3b qwen3.6-27b qwen3.6-35b-a3b}; do
  [ $(( ${LIMIT:-540} - $(el) )) -gt 90 ] || break
  timeout $(( ${LIMIT:-540} - $(el) - 10 )) python3 deploy/bench/hf_baseline.py --out $OUT/t/hf-$m.json --model $m \
    --sizes 1,16 --steps 16 --reps 3 > $OUT/t/hf-$m.log 2>&1
  echo "$m rc=$? at $(el) s"; tail -c 1500 $OUT/t/hf-$m.log
done
tar -C $OUT -cJf $OUT/t.tar.xz t && rm -rf $OUT/t
echo "done at $(el) s"
