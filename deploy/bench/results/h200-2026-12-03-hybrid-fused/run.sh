#!/usr/bin/env bash
# Device call: the hybrid checks and the Qwen3.6-27B-shaped bench (fused path against plain).
# Runs from the session checkout with this script and the bundle copied into its ignored .gpu-20/
# (the device gets that checkout, not this worktree): carry [".gpu-20"], run `bash .gpu-20/run.sh`.
set -euo pipefail
mkdir -p /tmp/b && tar -xJf .gpu-20/bundle.tar.xz -C /tmp/b && . /tmp/b/env.sh
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader || true
DFLASH_TESTS_DIR=$PWD/tests gpu_check cuda "$OUT/gpu_check_hybrid.json" --hybrid 2>&1 | tail -40
