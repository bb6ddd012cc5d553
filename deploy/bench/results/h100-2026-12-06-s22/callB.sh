#!/usr/bin/env bash
# Issue 18: the 8B recipe's len x batch table under the explicit engine (2048 / 3072 / 4096
# tokens x batch 1 / 2 / 4, 4 steps each): sequence tok/s, drafter / target time per step, MFU,
# peak memory, an OOM reported as such. PIPE=1 runs it with the pipelined dk/dv kernel (use
# callA's winner).
set -u
D=${D:-.gpu-train}
mkdir -p /tmp/b && tar -xJf $D/bundle.tar.xz -C /tmp/b && . /tmp/b/env.sh
mkdir -p $OUT/s
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee $OUT/s/gpu.txt
DFLASH_DKV_PIPELINED=${PIPE:-0} TRAIN=/tmp/b/dflash-train CHECK=/tmp/b/gpu_check OUT=$OUT/s TLIM=60 \
  ENGINES=explicit SWEEP=1 SWEEP_STEPS=4 bash deploy/bench/train_engines.sh
tar -C $OUT -cJf $OUT/sweep.tar.xz s && rm -rf $OUT/s
