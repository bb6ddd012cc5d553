#!/bin/bash
mkdir -p /tmp/b && tar -xJf .gpu/lead/bundle.tar.xz -C /tmp/b && . /tmp/b/env.sh
run() { local name=$1 bin=$2; $bin bench --variants fast --no-e2e --contexts 1024 --sizes 1,16 --prefill 256 --decode-steps 64 --out $OUT/$name.json > /dev/null 2> $OUT/$name.err; echo "$name rc=$?"; }
run base_a dflash-serve-base
run new_a dflash-serve
run base_b dflash-serve-base
run new_b dflash-serve
