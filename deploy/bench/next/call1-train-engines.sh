#!/usr/bin/env bash
# Issue 18: the explicit training engine on the GPU (checks, then the 8B recipe under each engine).
set -u
D=${D:-.gpu-train}
mkdir -p /tmp/b && tar -xJf $D/bundle.tar.xz -C /tmp/b && . /tmp/b/env.sh
mkdir -p $OUT/t
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee $OUT/t/gpu.txt
export DFLASH_TESTS_DIR=$PWD/tests
TRAIN=/tmp/b/dflash-train CHECK=/tmp/b/gpu_check OUT=$OUT/t TLIM=170 STEPS=12 \
  bash deploy/bench/train_engines.sh
tar -C $OUT -cJf $OUT/train-engines.tar.xz t && rm -rf $OUT/t
