#!/bin/bash
mkdir -p /tmp/b && tar -xJf .gpu/lead/bundle.tar.xz -C /tmp/b && . /tmp/b/env.sh
run() { local name=$1; shift; env "$@" dflash-serve bench --variants fast --no-e2e --contexts 1024 --sizes 1,16 --prefill 256 --decode-steps 64 --out $OUT/$name.json > /dev/null 2> $OUT/$name.err; echo "$name rc=$?"; }
run base_a DFLASH_STEP_ARENA=0
run arena_a DFLASH_EARLY_START=0
run early_a X=1
run base_b DFLASH_STEP_ARENA=0
run early_b X=1
