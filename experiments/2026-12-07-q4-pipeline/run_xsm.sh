#!/bin/bash
# Not yet run (no device could be started). On the H200 (or an H100), one call: run 2 of q4_pipe.py (x
# staged in shared memory at M > 8, xsm.patch) and the 8B shape at MLX 4-bit built with it against the
# bf16 build, the 4-bit steps' kernels (CUPTI), no torch peer. Host steps: `git apply
# experiments/2026-12-07-q4-pipeline/xsm.patch && make kernels`; `q4_pipe.py build --out .gpu/q4xsm --run 2`;
# experiments/2026-12-03-q4-gpu/prepare_8b.py (.gpu/8b-q4-b16-sm_80), bench/speed_8b.py prepare --blocks 16
# (.gpu/8b-b16-sm_80); bench/pack_device.py wheels and artifacts 8b-q4-b16-sm_80 8b-b16-sm_80. Carry
# [".gpu/wheels", ".gpu/artifacts.zip", ".gpu/q4xsm"]:
#   bash bench/on_device.sh bash experiments/2026-12-07-q4-pipeline/run_xsm.sh
set -uo pipefail
out=${OUT:-/tmp/out}
card=$(python3 -c "import torch; n = torch.cuda.get_device_name(0); print('h200' if 'H200' in n else 'h100' if 'H100' in n else 'gpu')")
bash experiments/2026-12-07-q4-pipeline/run_device.sh .gpu/q4xsm q4_xsm
python3 experiments/2026-12-03-q4-gpu/run_8b.py --profile --no-peer --bf16 .gpu/8b-b16-sm_80 \
  --json "$out/q4_8b_xsm_$card.json" 2>&1 | grep -v Warning | tail -14 || echo "8b exit $?"
