#!/bin/bash
# On the H200, one call (carry [".gpu/wheels", ".gpu/artifacts.zip"]; README.md here has the host steps):
#   bash bench/on_device.sh bash experiments/2026-12-03-gemm-m1-variants/run_device.sh
# The skinny GEMM at 16 chunks a round (GM_U 16) against 8, in whole builds:
# 1. the 8B shape (block 8): .gpu/8b-b8-u16-sm_80 against .gpu/8b-b8-k4-sm_80 (the same export, the GEMM
#    object of 8 chunks), alternated three times in one process, and torch.compile reduce-overhead;
# 2. the kernel times of the u16 build (bench/speed_8b.py --profile), for the step's time split;
# 3. the demo pair: .gpu/demo-u16-sm_80 against .gpu/demo-k4-sm_80, alternated: plain and DFlash tok/s,
#    drafted == plain greedy and at T = 1.
set -uo pipefail
out=${OUT:-/tmp/out}
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv > "$out/gpu.csv" 2>&1
python3 bench/speed_8b.py run --arch sm_80 --blocks 8 --variant=-u16 --against=-k4 --rounds 3 \
    --peers reduce-overhead --json "$out/speed_8b_u16_h200.json" 2>&1 | tail -40 || echo "8b exit $?"
if [ -d .gpu/demo-u16-sm_80 ]; then
  python3 experiments/2026-12-03-host-row-ops/before_after.py --device cuda --before .gpu/demo-k4-sm_80 \
      --after .gpu/demo-u16-sm_80 --json "$out/demo_u16_h200.json" 2>&1 | tail -6 || echo "demo exit $?"
fi
python3 bench/speed_8b.py run --arch sm_80 --blocks 8 --variant=-u16 --no-peers --profile \
    --json "$out/profile_8b-u16.json" 2>&1 | tail -30 || echo "profile exit $?"
