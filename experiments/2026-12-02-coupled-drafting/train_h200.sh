#!/bin/bash
# The device call that trained the distilled demo drafters (block 8, two soft weights, half of the
# continuations sampled at T = 1): run tool, carry [".gpu"] (.gpu/train-data.tgz: train.bin and the prompt sets
# of .train-data/, packed so that the carry fits in 64 MiB).
set -euo pipefail
tar xzf .gpu/train-data.tgz
bash bench/on_device.sh bash -c 'cd train && python3 train_drafter.py --data ../.train-data --target ../models/demo/target --out $OUT --blocks 8 --sampled 0.5 --soft-weights 1,0.5 --steps 5000 --eval-every 1000 --seed 0 --time-limit 330'
