#!/usr/bin/env bash
# Session 15 (graph helper)'s one device call: gpu_check --hybrid with the CUDA graph of the
# fused hybrid decode step (qwen3_5/graph.rs) checked against the eager step and timed.
# Bundle and script carried in .gpu-graph/ of the session checkout.
set -u
mkdir -p /tmp/b && tar -xJf .gpu-graph/bundle.tar.xz -C /tmp/b && . /tmp/b/env.sh
T0=$(date +%s)
DFLASH_TESTS_DIR=$PWD/tests timeout 140 /tmp/b/gpu_check cuda $OUT/gpu_check_hybrid.json --hybrid > $OUT/hybrid.log 2>&1
echo "gpu_check --hybrid rc=$? in $(( $(date +%s) - T0 )) s"; grep -iE "error|panick" $OUT/hybrid.log | head -5 | cut -c1-400
grep "decode graph vs eager" $OUT/hybrid.log | cut -c1-2000
python3 - <<'PY'
import json, os
try: r = json.load(open(os.environ['OUT'] + '/gpu_check_hybrid.json'))
except Exception as e: print('no hybrid json', e); raise SystemExit
def walk(x, path=''):
    if isinstance(x, dict):
        for k, v in x.items(): walk(v, path + '/' + k)
    elif 'fused_gdn_layer' not in path and 'probe' not in path and 'noise' not in path:
        print('%-95s %s' % (path[-95:], x))
walk(r)
PY
