#!/bin/bash
# On the H200 (or an H100), one call: the mlx-lm-written 4-bit demo target with the bf16 demo drafter on
# this folder's 4-bit GEMM: drafted == plain, greedy and at T = 1, τ, tok/s (carry [".gpu/wheels",
# ".gpu/artifacts.zip"] with .gpu/demo-mlx4-sm_80 and .gpu/demo-mlx4-target; only models/demo/drafter
# of models/ in the tree):
#   bash bench/on_device.sh bash experiments/2026-12-07-q4-pipeline/run_demo.sh
set -uo pipefail
out=${OUT:-/tmp/out}
card=$(python3 -c "import torch; n = torch.cuda.get_device_name(0); print('h200' if 'H200' in n else 'h100' if 'H100' in n else 'gpu')")
python3 experiments/2026-12-03-q4-gpu/demo_q4.py --device cuda --arm mlx4 .gpu/demo-mlx4-sm_80 .gpu/demo-mlx4-target \
  --json "$out/demo_q4_$card.json" 2>&1 | tail -6 || echo "demo exit $?"
