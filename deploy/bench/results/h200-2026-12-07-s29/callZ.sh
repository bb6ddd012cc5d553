#!/usr/bin/env bash
# Session 29: where a MoE target's 4K prefill goes, by phase (CUDA events at the marks of
# decoder_stack.rs's wide path and moe_grouped.rs for the Coder, qwen3_5's for the 35B-A3B),
# grouped GEMMs on (the default) and off. Bundle: dflash-serve + gpu_check. ~120 s.
set -u
D=${D:-.gpu-next}
mkdir -p /tmp/b && tar -xJf $D/bundle.tar.xz -C /tmp/b && . /tmp/b/env.sh
T0=$(date +%s); el() { echo $(( $(date +%s) - T0 )); }
mkdir -p $OUT/z
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/z/gpu.txt; cat $D/BUILT
for g in 1 0; do
  for m in qwen3-coder-30b-a3b qwen3.6-35b-a3b; do
    DFLASH_MOE_GROUPED_GEMM=$g timeout 70 /tmp/b/dflash-serve bench --model $m --prefill 4096 --e2e-prompt 256 --e2e-tokens 8 \
      --budgets 16 --no-e2e-check --out $OUT/z/$m-g$g.json > $OUT/z/$m-g$g.log 2>&1
    echo "$m g$g rc=$? at $(el) s"; grep -m2 -iE "error|panic" $OUT/z/$m-g$g.log | cut -c1-300
    python3 -c "
import json,sys; d=json.load(open(sys.argv[1])); p=d['prefill_4096']; ph=d['prefill_4096_phases']
print('$m g$g prefill s', round(p['seconds'],4), 'profiled s', round(ph['seconds'],4), {k: round(v['ms'],2) for k, v in ph['phases'].items()})
" $OUT/z/$m-g$g.json 2>&1 | cut -c1-900
  done
done
tar -C $OUT -cJf $OUT/z.tar.xz z && rm -rf $OUT/z
echo "done at $(el) s"
