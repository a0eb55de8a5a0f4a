#!/bin/bash
# On the H200 (or an H100), one call: the 4-bit GEMM of this folder as `make compile` builds it
# (carry [".gpu/wheels", ".gpu/artifacts.zip"] with .gpu/q4, .gpu/8b-q4-b16-sm_80, .gpu/8b-b16-sm_80;
# models/ and kernels/objects/ moved out of the tree for the call: the device needs neither):
#   bash bench/on_device.sh bash experiments/2026-12-07-q4-pipeline/run_8b.sh
# 1. bench/gemm_q4_bench.py at the 8B shapes through IREE: bits against the bf16 kernel in q4_k_order
#    (the new pair order), rows, time against torch.compile and cuBLAS;
# 2. the 8B shape at MLX 4-bit against the bf16 build in one process, the 4-bit step's kernels (CUPTI),
#    device memory and the torch.compile peer (experiments/2026-12-03-q4-gpu/run_8b.py).
set -uo pipefail
out=${OUT:-/tmp/out}
card=$(python3 -c "import torch; n = torch.cuda.get_device_name(0); print('h200' if 'H200' in n else 'h100' if 'H100' in n else 'gpu')")
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv > "$out/gpu_8b.csv" 2>&1
python3 bench/gemm_q4_bench.py run --modules .gpu/q4 --json "$out/gemm_q4_$card.json" 2>&1 | tail -24 || echo "gemm exit $?"
python3 experiments/2026-12-03-q4-gpu/run_8b.py --profile --bf16 .gpu/8b-b16-sm_80 --json "$out/q4_8b_$card.json" 2>&1 \
  | grep -v Warning | tail -40 || echo "8b exit $?"
