#!/usr/bin/env bash
# Session 28, second call (bundle: dflash-serve + gpu_check with gattn_split2 on by default and
# DFLASH_GEMV_PRELOAD): one binary, four settings on one machine, interleaved so drift shows:
#   A  DFLASH_GEMV_PRELOAD=0 DFLASH_PDL=0   (session 27's one-row GEMV with the input norm)
#   B  DFLASH_GEMV_PRELOAD=1 DFLASH_PDL=0   (its first weight spans before the norm)
#   C  DFLASH_GEMV_PRELOAD=1 DFLASH_PDL=1   (and before the PDL wait; late PDL triggers)
#   D  DFLASH_GEMV_PRELOAD=0 DFLASH_PDL=1
# Decode at 1K: Qwen3-8B (`bench --variants fast`, graph and eager), Qwen3.6-27B and -35B-A3B
# through the engine (graphs their default way and the other way, greedy tokens checked both
# ways), Qwen3-Coder-30B-A3B (`gpu_check --moe`, graph and eager).
set -u
D=${D:-.gpu-s28}
mkdir -p /tmp/b && tar -xJf $D/bundle.tar.xz -C /tmp/b && . /tmp/b/env.sh
T0=$(date +%s); el() { echo $(( $(date +%s) - T0 )); }
mkdir -p $OUT/u
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee $OUT/u/gpu.txt; cat $D/BUILT
export DFLASH_TESTS_DIR=$PWD/tests
cfg() { case $1 in A) echo "DFLASH_GEMV_PRELOAD=0 DFLASH_PDL=0";; B) echo "DFLASH_GEMV_PRELOAD=1 DFLASH_PDL=0";;
  C) echo "DFLASH_GEMV_PRELOAD=1 DFLASH_PDL=1";; D) echo "DFLASH_GEMV_PRELOAD=0 DFLASH_PDL=1";; esac; }
q8() {  # setting, rep
  env $(cfg $1) timeout 60 /tmp/b/dflash-serve bench --model qwen3-8b --variants fast --contexts 1024 --batch-sizes \
    --sizes 1 --budgets 16 --e2e-tokens 64 --out $OUT/u/q8-$1$2.json > $OUT/u/q8-$1$2.log 2>&1
  python3 -c "import json,sys; d=json.load(open(sys.argv[1])); f=d['variants']['fast']; x=f['decode']; e=f.get('e2e',{}); print('q8 $1$2', round(x['ctx_1024_cuda_graph']['ms'],3), round(x['ctx_1024']['ms'],3), 'e2e', {k: round(v.get('tok_per_s',0),1) for k, v in e.items() if isinstance(v, dict)}, 'identical', [v.get('identical') for v in f.get('e2e_step_graph_check', {}).values() if isinstance(v, dict)])" $OUT/u/q8-$1$2.json 2>&1 | cut -c1-400
}
fam() {  # model, setting, rep
  env $(cfg $2) timeout 90 /tmp/b/dflash-serve bench --model $1 --prefill 1024 --e2e-prompt 1024 \
    --e2e-tokens 64 --budgets 16 --out $OUT/u/$1-$2$3.json > $OUT/u/$1-$2$3.log 2>&1
  python3 -c "
import json,sys; d=json.load(open(sys.argv[1])); a=d['decode_through_engine']; b=[v for k, v in d.items() if k.startswith('decode_step_graphs_')][0]
e=d['e2e']; c=d.get('e2e_step_graph_check', {})
print('$1 $2$3', round(a['ms_per_token'],3), 'graphs', a.get('step_graphs'), 'other way', round(b['ms_per_token'],3), 'e2e', {k: round(e[k].get('speedup_vs_plain'),2) for k in ('chain', 'ddtree_16') if k in e}, 'identical', [v.get('identical') for v in c.values()])
" $OUT/u/$1-$2$3.json 2>&1 | cut -c1-400
}
coder() {  # setting
  env $(cfg $1) timeout 60 /tmp/b/gpu_check cuda $OUT/u/coder-$1.json --moe > $OUT/u/coder-$1.log 2>&1
  python3 -c "
import json,sys; d=json.load(open(sys.argv[1])); b=d['qwen3_coder_30b_a3b_shape_bench']['decode_1']; f=d['moe_target_fused_vs_plain_4_layers']['decode_1']['graph_vs_eager']
print('coder $1', round(b['graph_ms'],3), round(b['eager_ms'],3), round(b['fraction_of_roofline'],3), 'router_route', d['moe_router_route'].get('pass'), 'graph_vs_eager', f['max_abs_diff'])
" $OUT/u/coder-$1.json 2>&1 | cut -c1-400
}
for s in A B C D; do q8 $s 1; done; echo "at $(el) s"
for s in A B C D; do fam qwen3.6-27b $s 1; done; echo "at $(el) s"
for s in A B C D; do coder $s; done; echo "at $(el) s"
for s in A B C D; do fam qwen3.6-35b-a3b $s 1; done; echo "at $(el) s"
for s in D C B A; do [ $(( ${LIMIT:-300} - $(el) )) -gt 20 ] && q8 $s 2; done
for s in D C B A; do [ $(( ${LIMIT:-300} - $(el) )) -gt 25 ] && fam qwen3.6-27b $s 2; done
tar -C $OUT -cJf $OUT/u.tar.xz u && rm -rf $OUT/u
echo "done at $(el) s"
