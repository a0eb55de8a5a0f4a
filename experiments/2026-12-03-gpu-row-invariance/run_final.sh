#!/bin/bash
# On the H200, the build `make compile` makes after this change (row-invariant lowerings, 8 decode steps a
# call) against the build before, one call (carry as run_device.sh):
#   bash bench/on_device.sh bash experiments/2026-12-03-gpu-row-invariance/run_final.sh
# 1. the 8B shape (block 8): .gpu/8b-b8-k4-sm_80 (this build) against .gpu/8b-b8-s1-sm_80 (before),
#    alternated three times in one process, and torch.compile reduce-overhead;
# 2. the demo pair: .gpu/demo-k4-sm_80 against .gpu/demo-sm_80 (the rules before), alternated:
#    plain and DFlash tok/s, drafted == plain greedy and at T = 1;
# 3. solo == together on the demo pair's 4-stream module of this build (.gpu/demo-s4-ri-sm_80).
set -uo pipefail
out=${OUT:-/tmp/out}
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv > "$out/gpu.csv" 2>&1
python3 bench/speed_8b.py run --arch sm_80 --blocks 8 --variant=-k4 --against=-s1 --rounds 3 \
    --peers reduce-overhead --json "$out/speed_8b_k4_h200.json" 2>&1 | tail -40 || echo "8b exit $?"
python3 experiments/2026-12-03-host-row-ops/before_after.py --device cuda --before .gpu/demo-sm_80 \
    --after .gpu/demo-k4-sm_80 --json "$out/demo_k4_before_after_h200.json" 2>&1 | tail -6 || echo "demo exit $?"
python3 experiments/2026-12-03-gpu-row-invariance/solo_together.py --artifacts .gpu/demo-s4-ri-sm_80 --device cuda \
    --json "$out/solo_together_h200.json" 2>&1 | tail -3 || echo "solo exit $?"
