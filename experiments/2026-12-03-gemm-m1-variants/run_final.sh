#!/bin/bash
# On the H200, one call (carry as run_device.sh): the GEMM as committed (16 chunks a round, then a round of
# 8 for a short split) against the build before (8 chunks a round):
# 1. the 8B shape (block 8): .gpu/8b-b8-u16r-sm_80 against .gpu/8b-b8-k4-sm_80, alternated three times in
#    one process, and torch.compile reduce-overhead;
# 2. the demo pair (K = 384: 12 chunks a split, the half round's case): .gpu/demo-u16r-sm_80 against
#    .gpu/demo-k4-sm_80, alternated: plain and DFlash tok/s, drafted == plain greedy and at T = 1.
set -uo pipefail
out=${OUT:-/tmp/out}
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv > "$out/gpu.csv" 2>&1
python3 experiments/2026-12-03-host-row-ops/before_after.py --device cuda --before .gpu/demo-k4-sm_80 \
    --after .gpu/demo-u16r-sm_80 --rounds 5 --json "$out/demo_u16r_h200.json" 2>&1 | tail -6 || echo "demo exit $?"
python3 bench/speed_8b.py run --arch sm_80 --blocks 8 --variant=-u16r --against=-k4 --rounds 3 \
    --peers reduce-overhead --json "$out/speed_8b_u16r_h200.json" 2>&1 | tail -20 || echo "8b exit $?"
