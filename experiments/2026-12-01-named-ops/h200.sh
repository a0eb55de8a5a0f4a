#!/bin/bash
# One device call (the `run` tool, nvidia-h200) after the redesign of issues #20-#22 (named ops and
# their lowering, kernel folders, arch table, typed manifest; the Request loop; wheels installed on
# the device): exactness from the installed wheels, and the 8B speed of this build beside the build
# before it, alternated in one process. Made here by
#   python bench/speed_8b.py prepare --arch h200 --blocks 16                  # this build
#   (at 9e1706a) python bench/speed_8b.py prepare --arch h200 --blocks 16 --variant pre
#   python bench/gpu_check.py prepare --arch sm_80
#   make device-wheels; make device-artifacts NAMES="tiny tiny-sm_80 demo-sm_80 expected.json 8b-b16-sm_80 8b-b16pre-sm_80"
# and carried as [".gpu/wheels", ".gpu/artifacts.zip"].
set -uo pipefail

nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
timeout 200 bash bench/on_device.sh python3 bench/gpu_check.py run --device cuda --arch sm_80 --json "$OUT/gpu_check_h200.json" || echo "gpu_check failed: $?"
timeout 330 bash bench/on_device.sh python3 bench/speed_8b.py run --no-peers --blocks 16 --against pre --rounds 3 \
    --json "$OUT/speed_8b_h200_alternated.json" || echo "speed_8b failed: $?"
