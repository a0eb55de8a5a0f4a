#!/bin/bash
# On the H200 (or an H100), one call, carry [".gpu/attn"] (attn_raw.py build --out .gpu/attn):
#   bash experiments/2026-12-07-decode-attention/run_device.sh
# The variants' bits and times, then Nsight Compute on base and pm at decode (T = 1, N = 530).
set -uo pipefail
out=${OUT:-/tmp/out}
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv > "$out/gpu.csv" 2>&1
card=$(python3 -c "import torch; n = torch.cuda.get_device_name(0); print('h200' if 'H200' in n else 'h100' if 'H100' in n else 'gpu')")
timeout 300 python3 experiments/2026-12-07-decode-attention/attn_raw.py run --dir .gpu/attn --json "$out/attn_raw_$card.json" 2>&1 | grep -v Warning | tail -20
if command -v ncu > /dev/null; then
  for v in base pm; do
    timeout 60 ncu --kernel-name regex:dflash_attention --launch-skip 2 --launch-count 1 \
      --section SpeedOfLight --section WarpStateStats --section LaunchStats --section Occupancy \
      python3 experiments/2026-12-07-decode-attention/attn_raw.py one --dir .gpu/attn --variant $v > "$out/ncu_decode_${v}_$card.txt" 2>&1
    grep -E "Duration|Registers|Stall|Warp Cycles|Achieved Occupancy" "$out/ncu_decode_${v}_$card.txt" | head -12
  done
else
  echo "no ncu"
fi
