#!/usr/bin/env bash
# Issue 20's HF transformers baseline at the family shapes (random bf16 weights, built in bf16:
# session 18's f32 build of the 27B ran out of memory), beside `dflash-serve bench` of the same
# shapes: decode at 1K, a 4096-token prefill, and for the Coder the chain forwards over a 1K
# cache; then, with a bundle in D (dflash-serve + gpu_check), our `dflash-serve bench` of each
# shape on the same machine (decode at 1K, 4K prefill, chain-16), so the ratios are within one
# call. PyTorch + transformers of the machine. ~80-140 s a family.
set -u
D=${D:-.gpu-next}
[ -f $D/bundle.tar.xz ] && mkdir -p /tmp/b && tar -xJf $D/bundle.tar.xz -C /tmp/b && . /tmp/b/env.sh
T0=$(date +%s); el() { echo $(( $(date +%s) - T0 )); }
mkdir -p $OUT/t
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee $OUT/t/gpu.txt
for m in ${MODELS:-qwen3-coder-30b-a3b qwen3.6-27b qwen3.6-35b-a3b}; do
  [ $(( ${LIMIT:-540} - $(el) )) -gt 90 ] || break
  timeout $(( ${LIMIT:-540} - $(el) - 10 )) python3 deploy/bench/hf_baseline.py --out $OUT/t/hf-$m.json --model $m \
    --sizes 1,16 --steps 16 --reps 3 > $OUT/t/hf-$m.log 2>&1
  echo "$m rc=$? at $(el) s"; tail -c 1200 $OUT/t/hf-$m.log
  if [ -x /tmp/b/dflash-serve ] && [ $(( ${LIMIT:-540} - $(el) )) -gt 50 ]; then
    timeout 60 /tmp/b/dflash-serve bench --model $m --prefill 4096 --e2e-prompt 1024 --e2e-tokens 32 \
      --budgets 16 --no-e2e-check --out $OUT/t/ours-$m.json > $OUT/t/ours-$m.log 2>&1
    echo "ours $m rc=$? at $(el) s"
    python3 -c "
import json,sys; d=json.load(open(sys.argv[1]))
print({k: (round(v['ms_per_token'],3) if 'ms_per_token' in v else v) for k, v in d.items() if k.startswith(('decode_', 'prefill_', 'verify')) and not k.endswith('phases')})
" $OUT/t/ours-$m.json 2>&1 | cut -c1-700
  fi
done
tar -C $OUT -cJf $OUT/t.tar.xz t && rm -rf $OUT/t
echo "done at $(el) s"
