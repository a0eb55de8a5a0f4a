#!/bin/bash
# On an H100 or H200, one call: the 8B shape at bf16 with the padded two-level argmax (the product's form
# since this experiment) against the build before it, alternated in one process, with the kernel profile.
# Host steps: bench/speed_8b.py prepare --arch sm_80 --blocks 16 --variant am (export/sampling.py as
# committed), beside .gpu/8b-b16-sm_80 (the one-level form); bench/pack_device.py wheels, and
# artifacts 8b-b16-sm_80 8b-b16am-sm_80. Carry [".gpu/wheels", ".gpu/artifacts.zip"]:
#   bash bench/on_device.sh bash experiments/2026-12-07-argmax/run_padded.sh
set -uo pipefail
out=${OUT:-/tmp/out}
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv > "$out/gpu_padded.csv" 2>&1
card=$(python3 -c "import torch; n = torch.cuda.get_device_name(0); print('h200' if 'H200' in n else 'h100' if 'H100' in n else 'gpu')")
ln -sfn 8b-b16-sm_80 .gpu/8b-b16base-sm_80
timeout 230 python3 bench/speed_8b.py run --blocks 16 --variant am --against base --rounds 3 --profile --no-peers \
  --json "$out/speed_8b_padded_$card.json" 2>&1 | grep -v Warning | tail -24
