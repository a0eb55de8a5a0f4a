#!/bin/bash
# On the H200, one call, the 4-bit GEMM's super-chunk form as committed (carry [".gpu/wheels",
# ".gpu/artifacts.zip"]; README.md has the host steps):
#   bash bench/on_device.sh bash experiments/2026-12-04-q4-superchunk/run_device.sh
# 1. bench/gemm_q4_bench.py at the 8B shapes through IREE: bits against the bf16 kernel (in q4_k_order),
#    rows, time against torch.compile and cuBLAS;
# 2. the 8B shape at MLX 4-bit against the bf16 build in one process, the step's kernels (CUPTI) and
#    the torch.compile peer (experiments/2026-12-03-q4-gpu/run_8b.py);
# 3. the mlx-lm-written demo target with the bf16 drafter against the bf16 demo target: drafted ==
#    plain, greedy and at T = 1, τ, tok/s (experiments/2026-12-03-q4-gpu/demo_q4.py).
set -uo pipefail
out=${OUT:-/tmp/out}
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv > "$out/gpu.csv" 2>&1
if [ -d .gpu/q4 ]; then
  python3 bench/gemm_q4_bench.py run --modules .gpu/q4 --json "$out/gemm_q4_h200.json" 2>&1 | tail -24 || echo "gemm exit $?"
fi
if [ -d .gpu/8b-q4-b16-sm_80 ]; then
  python3 experiments/2026-12-03-q4-gpu/run_8b.py --profile --json "$out/q4_8b_h200.json" 2>&1 | tail -30 || echo "8b exit $?"
fi
if [ -d .gpu/demo-mlx4-sm_80 ]; then
  python3 experiments/2026-12-03-q4-gpu/demo_q4.py --device cuda --arm bf16 .gpu/demo-u16r-sm_80 models/demo/target \
    --arm mlx4 .gpu/demo-mlx4-sm_80 .gpu/demo-mlx4-target --json "$out/demo_q4_h200.json" 2>&1 | tail -8 || echo "demo exit $?"
fi
