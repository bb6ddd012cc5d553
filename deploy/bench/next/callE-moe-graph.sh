#!/usr/bin/env bash
# Issue 20: the hybrid decode step graphs in the engine (graph.rs `forward_decode_graph`, off by
# default: DFLASH_HYBRID_DECODE_GRAPHS) on a 12-layer Qwen3.6-35B-A3B-shaped target (the
# published shape's layers cut to 12: 9 GDN + 3 gated attention, 256 experts top 8;
# `qwen3.6-35b-a3b-12-layers.json`): decode through the engine eager (decode_through_engine)
# and from graphs (decode_step_graphs_on), greedy tokens identical both ways
# (e2e_step_graph_check). Bundle: dflash-serve. TOTAL=1 runs the published 40-layer shape too
# (`--model qwen3.6-35b-a3b`, ~3 min); if the graphs win, make them the default
# (models/src/cuda/mod.rs `HYBRID_DECODE_GRAPHS`) and rerun the 27B shape to see they cost it
# nothing.
set -u
D=${D:-.gpu-serve}
mkdir -p /tmp/b && tar -xJf $D/bundle.tar.xz -C /tmp/b && . /tmp/b/env.sh
T0=$(date +%s); el() { echo $(( $(date +%s) - T0 )); }
mkdir -p $OUT/g
export RUST_LOG=warn
timeout ${TLIM:-120} /tmp/b/dflash-serve bench --model deploy/bench/next/qwen3.6-35b-a3b-12-layers.json \
  --e2e-only --prefill 1024 --e2e-prompt 1024 --e2e-tokens 128 --budgets 16 --out $OUT/g/h35-12.json > $OUT/g/h35-12.log 2>&1
echo "bench 35b-a3b 12 layers rc=$? at $(el) s"
python3 - $OUT/g/h35-12.json <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
for k in ("decode_through_engine", "decode_step_graphs_on", "e2e_step_graph_check"):
    print(k, json.dumps(d.get(k)))
PY
if [ "${TOTAL:-0}" = 1 ]; then
  timeout 230 /tmp/b/dflash-serve bench --model qwen3.6-35b-a3b --e2e-only --e2e-prompt 1024 --e2e-tokens 128 \
    --budgets 16,64 --out $OUT/g/h35.json > $OUT/g/h35.log 2>&1
  echo "bench 35b-a3b rc=$? at $(el) s"
fi
echo "done at $(el) s"
