#!/usr/bin/env bash
set -u
mkdir -p /tmp/b && tar -xJf .gpu-tree/bundle.tar.xz -C /tmp/b && . /tmp/b/env.sh
DFLASH_TESTS_DIR=$PWD/tests timeout 150 /tmp/b/gpu_check cuda $OUT/gpu_check_hybrid.json --hybrid > $OUT/hybrid.log 2>&1
echo "gpu_check --hybrid rc=$?"; tail -n 5 $OUT/hybrid.log | cut -c1-200
python3 - <<'PY'
import json, os
try: r = json.load(open(os.environ['OUT'] + '/gpu_check_hybrid.json'))
except Exception as e: print('no hybrid json', e); raise SystemExit
def walk(x, path=''):
    if isinstance(x, dict):
        for k, v in x.items(): walk(v, path + '/' + k)
    elif isinstance(x, (int, float, bool)) and 'fused_gdn_layer' not in path:
        print('%-75s %s' % (path[-75:], x))
walk(r)
PY
