#!/bin/bash
# Issue 26, call 1 of 2 on the GPU: the GDN step with every_row as a push constant (f92ddf9), its bits
# against kernels/gdn/reference.py (every-row and last-state-only forms, now with a wheel checked to be
# this tree's: bench/on_device.sh), what every row's state writes cost at the 27B layer shape, and the
# hybrid pairs' exactness with a prefill on the kernel (tiny float32 pair == eager with a 150-token
# prompt: two prefill chunks of 64; demo-qwen35 DFlash == plain and == exact).
#   here:   bench/gdn_check.py prepare --arch sm_80 --iree
#           bench/gpu_check.py prepare --arch sm_80 --pair qwen35
#           bench/pack_device.py wheels
#           bench/pack_device.py artifacts gdn tiny35 tiny35-sm_80 demo35-sm_80 expected35.json
#   device: bash experiments/2026-12-06-gdn-prefill/run_checks.sh   (carry .gpu/wheels, .gpu/artifacts.zip;
#           the tree with models/demo-qwen35, without kernels/objects and models/demo: the 64 MiB carry)
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader
run() { timeout "$1" bash bench/on_device.sh "${@:2}" 2>&1 | grep -v Warning | tail -14; }
run 120 python3 bench/gdn_check.py run --json "$OUT/gdn_check.json"
run 200 python3 bench/gpu_check.py run --pair qwen35 --arch sm_80 --runs 1 --json "$OUT/gpu_check_qwen35.json"
exit 0
