#!/bin/bash
mkdir -p /tmp/b && tar -xJf .gpu/lead/bundle2.tar.xz -C /tmp/b
export LD_LIBRARY_PATH=/usr/local/cuda-13.0/targets/x86_64-linux/lib:$LD_LIBRARY_PATH
A="bench --variants fast --e2e-only --e2e-tokens 512"
timeout 100 /tmp/b/dflash-serve-base $A --out $OUT/base.json > $OUT/base.log 2>&1; echo base=$?
timeout 100 /tmp/b/dflash-serve $A --out $OUT/new.json > $OUT/new.log 2>&1; echo new=$?
timeout 100 /tmp/b/dflash-serve-base $A --out $OUT/base2.json > $OUT/base2.log 2>&1; echo base2=$?
timeout 100 /tmp/b/dflash-serve $A --out $OUT/new2.json > $OUT/new2.log 2>&1; echo new2=$?
