#!/bin/bash
# On the H200, one call (carry [".gpu/wheels", ".gpu/artifacts.zip"]; prepare.py here builds what it needs):
#   bash bench/on_device.sh bash experiments/2026-12-03-gpu-row-invariance/run_device.sh
# 1. decode's row against verify's row, bit for bit: demo pair and 8B shape, default / row-invariant /
#    planted-split builds (bench/row_invariance_check.py);
# 2. the demo pair, default build against row-invariant build, alternated in one process: plain and
#    DFlash tok/s, drafted == plain greedy and at T = 1 (16 bench prompts);
# 3. the 8B shape (block 8): the row-invariant build against the default one (.gpu/8b-b8-s1-sm_80),
#    decode / verify / draft / round alternated three times, and torch.compile reduce-overhead.
# 4. decode_steps: ms per token at k = 1, 2, 4, 8 steps a call (experiments/2026-12-03-decode-steps/probe.py).
# STEPS="rows demo" runs only those (default: rows demo 8b steps).
set -uo pipefail
out=${OUT:-/tmp/out}
steps=${STEPS:-rows demo 8b steps}
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv > "$out/gpu.csv" 2>&1
[[ $steps == *rows* ]] && { python3 bench/row_invariance_check.py run --json "$out/row_invariance_h200.json" 2>&1 \
    | tail -12 || echo "rows exit $?"; }
[[ $steps == *demo* ]] && { python3 experiments/2026-12-03-host-row-ops/before_after.py --device cuda \
    --before .gpu/demo-sm_80 --after .gpu/demo-ri-sm_80 --json "$out/demo_before_after_h200.json" 2>&1 | tail -8 \
    || echo "demo exit $?"; }
[[ $steps == *8b* ]] && python3 bench/speed_8b.py run --arch sm_80 --blocks 8 --variant=-ri --against=-s1 --rounds 3 \
    --peers reduce-overhead --json "$out/speed_8b_ri_h200.json" 2>&1 | tail -45 || echo "8b exit $?"
[[ $steps == *steps* ]] && { python3 experiments/2026-12-03-decode-steps/probe.py run --json "$out/decode_steps_h200.json" \
    2>&1 | tail -12 || echo "steps exit $?"; }
