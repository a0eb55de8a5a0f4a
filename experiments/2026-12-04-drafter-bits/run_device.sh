#!/bin/bash
# On the H200, one call (carry [".gpu/wheels", ".gpu/artifacts.zip"]): the mlx-lm-written 4-bit demo
# target with the bf16 demo drafter (.gpu/demo-mlx4-sm_80) and with the same drafter quantized on load
# (.gpu/demo-mlx4-d4-sm_80, compile --drafter-bits 4: the runtime quantizes it as it binds it), beside
# the bf16 demo target: drafted == plain greedy and at T = 1, τ, tok/s (experiments/2026-12-03-q4-gpu/demo_q4.py).
#   bash bench/on_device.sh bash experiments/2026-12-04-drafter-bits/run_device.sh
set -uo pipefail
out=${OUT:-/tmp/out}
python3 experiments/2026-12-03-q4-gpu/demo_q4.py --device cuda --arm bf16 .gpu/demo-u16r-sm_80 models/demo/target \
  --arm mlx4 .gpu/demo-mlx4-sm_80 .gpu/demo-mlx4-target --arm mlx4-d4 .gpu/demo-mlx4-d4-sm_80 .gpu/demo-mlx4-target \
  --json "$out/demo_d4_h200.json" 2>&1 | tail -8 || echo "demo exit $?"
ls -la ~/.cache/dflash-iree/quantized 2>&1 | tail -3
