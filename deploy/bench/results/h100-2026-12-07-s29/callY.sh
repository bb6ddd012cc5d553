#!/usr/bin/env bash
# Session 29: the wide MoE block's experts on cuBLAS grouped GEMMs (DFLASH_MOE_GROUPED_GEMM=1,
# moe_grouped.rs) against the tiled tensor-core kernels (=0), one machine: gpu_check --moe
# (moe_block at 1,000 rows against the plain block, the Coder 4-layer 600-row prefill against
# plain, the 1K prefill), the Coder and 35B-A3B 4K prefill through `dflash-serve bench`, and HF
# transformers' Coder 4K prefill in the same call. Bundle: dflash-serve + gpu_check. ~220 s.
set -u
D=${D:-.gpu-next}
mkdir -p /tmp/b && tar -xJf $D/bundle.tar.xz -C /tmp/b && . /tmp/b/env.sh
T0=$(date +%s); el() { echo $(( $(date +%s) - T0 )); }
mkdir -p $OUT/y
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/y/gpu.txt; cat $D/BUILT
export DFLASH_TESTS_DIR=$PWD/tests
for g in 1 0; do
  DFLASH_MOE_GROUPED_GEMM=$g timeout 80 /tmp/b/gpu_check cuda $OUT/y/coder-g$g.json --moe > $OUT/y/coder-g$g.log 2>&1; echo "coder g$g rc=$? at $(el) s"
  grep -m3 -iE "error|panic" $OUT/y/coder-g$g.log | cut -c1-400
  python3 -c "
import json,sys; d=json.load(open(sys.argv[1])); m=d['moe_block']; r=m.get('rows_1000', {}); b=d['qwen3_coder_30b_a3b_shape_bench']; f=d['moe_target_fused_vs_plain_4_layers']
print('g$g block pass', m.get('pass'), 'rows_1000', {k: r.get(k) for k in ('block_max_mean_rel_err_vs_plain_bf16', 'wrong_case_fails', 'device_ms', 'plain_ms')}, 'rows_100 ms', m.get('rows_100', {}).get('device_ms'), 'paths', r.get('expert_paths'))
print('g$g prefill_1k_ms', round(b['prefill_1k_ms'],2), 'decode', round(b['decode_1']['graph_ms'],3), '4-layer prefill_600 vs plain', f.get('prefill_600_last_10_rows'))
" $OUT/y/coder-g$g.json 2>&1 | cut -c1-900
done
for g in 1 0; do
  for m in qwen3-coder-30b-a3b qwen3.6-35b-a3b; do
    DFLASH_MOE_GROUPED_GEMM=$g timeout 70 /tmp/b/dflash-serve bench --model $m --prefill 4096 --e2e-prompt 1024 --e2e-tokens 32 \
      --budgets 16 --out $OUT/y/$m-g$g.json > $OUT/y/$m-g$g.log 2>&1
    echo "$m g$g rc=$? at $(el) s"; grep -m2 -iE "error|panic" $OUT/y/$m-g$g.log | cut -c1-300
    python3 -c "
import json,sys; d=json.load(open(sys.argv[1])); p=d['prefill_4096']; e=d.get('e2e', {})
print('$m g$g prefill_4096 s', round(p['seconds'],4), 'tok/s', round(p['tok_per_s']), 'of matmul', round(p['fraction_of_matmul_rate'],3), 'decode', round(d['decode_through_engine']['ms_per_token'],3), 'e2e chain', e.get('chain', {}).get('speedup_vs_plain'), 'tokens_match', e.get('chain', {}).get('tokens_match'), 'checks', {k: v for k, v in d.get('kernel_checks', {}).items() if 'pass' in str(k) or isinstance(v, bool)})
" $OUT/y/$m-g$g.json 2>&1 | cut -c1-700
  done
done
[ $(( 560 - $(el) )) -gt 60 ] && timeout $(( 560 - $(el) - 10 )) python3 deploy/bench/hf_baseline.py --out $OUT/y/hf-coder.json \
  --model qwen3-coder-30b-a3b --sizes 1 --steps 8 --reps 3 > $OUT/y/hf-coder.log 2>&1 && \
  python3 -c "import json,sys; d=json.load(open(sys.argv[1])); print('hf coder prefill_4096', d.get('prefill_4096'))" $OUT/y/hf-coder.json
tar -C $OUT -cJf $OUT/y.tar.xz y && rm -rf $OUT/y
echo "done at $(el) s"
