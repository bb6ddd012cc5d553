#!/usr/bin/env bash
D=.gpu-train
mkdir -p /tmp/b && tar -xJf $D/bundle.tar.xz -C /tmp/b && . /tmp/b/env.sh
timeout 150 ncu --clock-control none --metrics gpu__time_duration.sum --csv -k regex:"attn|dflash|linear_ce|adamw" --launch-count 400 \
  dflash-train train --target-model random:qwen3-8b --num-draft-layers 5 --block-size 16 --num-anchors 512 --target-devices cuda:0 --drafter-device cuda:0 --max-steps 100000 --save-every 100000000 --dataset synthetic:len=2048,n=40 --max-len 2048 --batch-size 4 --min-ready 4 --max-depth 8 --stop-after-steps 2 --log-every 1 --serialize-target --save-dtype bf16 --output-dir /tmp/run_ncu > /tmp/ncu.csv 2>/tmp/ncu.err
echo "rc=$?"; tail -3 /tmp/ncu.err | cut -c1-300
python3 $D/ncu_sum.py /tmp/ncu.csv 2>&1 | tee $OUT/ncu_summary.txt | head -45
xz -9 -c /tmp/ncu.csv > $OUT/ncu.csv.xz
