#!/usr/bin/env bash
# Session 29: where a MoE target's 4K prefill goes, by phase (CUDA events at the marks of
# decoder_stack.rs's wide path and moe_grouped.rs for the Coder, qwen3_5's for the 35B-A3B),
# grouped GEMMs on (the default) and off, and with the row gather kernel (`k1`:
# DFLASH_MOE_GATHER_KERNEL=1, unmeasured in session 29); first `gpu_check --moe` with the gather
# kernel on (`moe_block.rows_1000.expert_paths` checks all three expert paths against the plain
# block). Bundle: dflash-serve + gpu_check. ~170 s.
set -u
D=${D:-.gpu-next}
mkdir -p /tmp/b && tar -xJf $D/bundle.tar.xz -C /tmp/b && . /tmp/b/env.sh
T0=$(date +%s); el() { echo $(( $(date +%s) - T0 )); }
mkdir -p $OUT/z
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/z/gpu.txt; cat $D/BUILT
export DFLASH_TESTS_DIR=$PWD/tests
DFLASH_MOE_GATHER_KERNEL=1 timeout 80 /tmp/b/gpu_check cuda $OUT/z/coder-k1.json --moe > $OUT/z/coder-k1.log 2>&1; echo "gpu_check k1 rc=$?"
python3 -c "
import json,sys; m=json.load(open(sys.argv[1]))['moe_block']; print('moe_block pass', m.get('pass'), m.get('rows_1000', {}).get('expert_paths'))
" $OUT/z/coder-k1.json 2>&1 | cut -c1-700
for g in 1k1 1 0; do
  for m in qwen3-coder-30b-a3b qwen3.6-35b-a3b; do
    DFLASH_MOE_GROUPED_GEMM=${g:0:1} DFLASH_MOE_GATHER_KERNEL=$([ $g = 1k1 ] && echo 1 || echo 0) timeout 70 /tmp/b/dflash-serve bench --model $m --prefill 4096 --e2e-prompt 256 --e2e-tokens 8 \
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
