#!/bin/bash
# One H200 call (the `run` tool, carry [".gpu/wheels", ".gpu/train-data.tar.xz"]): two trainings side
# by side on the one GPU, each small enough to leave the other most of it:
#   1. the DFlash2 drafter b8 against models/demo/target (issue #27), the v1 drafter's budget:
#      5000 steps, batch 64, 32 anchors, the same corpus and seed;
#   2. the hybrid demo target, models/demo-qwen35/target (issue #25, stage 1).
# .train-data travels xz-packed: with the tracked tree it is over the 64 MiB a call carries.
set -uo pipefail
tar -xJf .gpu/train-data.tar.xz
nvidia-smi --query-gpu=name,memory.used --format=csv
bash bench/on_device.sh true  # installs the wheels into /tmp/site (paths relative to the root)
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
cd train
python3 train_drafter.py --dflash2 --blocks 8 --data ../.train-data \
  --target ../models/demo/target --out "$OUT/dflash2" --steps 5000 --eval-every 500 --seed 0 \
  --time-limit 420 > "$OUT/dflash2.log" 2>&1 &
a=$!
python3 train_target_qwen35.py --data ../.train-data --out "$OUT/qwen35" \
  --log "$OUT/qwen35/target_log.json" --steps 2500 --eval-every 100 --seed 0 --time-limit 420 \
  > "$OUT/qwen35.log" 2>&1 &
b=$!
wait $a; echo "dflash2 rc $?"; wait $b; echo "qwen35 rc $?"
tail -n 15 "$OUT/dflash2.log" "$OUT/qwen35.log"
rm -f "$OUT/qwen35/config.json" "$OUT/qwen35/generation_config.json"  # train_target_qwen35.py hybrid_config_dict() rewrites them
ls -la "$OUT" "$OUT"/*
