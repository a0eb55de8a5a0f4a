#!/bin/bash
# On the H200 (carry [".gpu/wheels", ".gpu/artifacts.zip"]; README.md here has the host steps):
#   bash bench/on_device.sh bash experiments/2026-12-03-q4-gpu/run_device.sh
# Each part runs when its artifacts travelled (two calls: the carry is capped at 64 MiB):
# 1. the packed GEMM at the 8B shapes: bits against the bf16 kernel, rows, time, torch.compile (bench/gemm_q4_bench.py);
# 2. a tiny bf16 compressed-tensors (zero points) pair: drafted == plain on the GPU, tokens against eager;
# 3. the demo target bf16 / MLX 4-bit / compressed-tensors 4-bit with the bf16 drafter (demo_q4.py);
# 4. the 8B shape at 4-bit against bf16 in one process, and the torch.compile peer (run_8b.py).
set -uo pipefail
out=${OUT:-/tmp/out}
here=experiments/2026-12-03-q4-gpu
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv > "$out/gpu.csv" 2>&1
if [ -d .gpu/q4 ]; then
  python3 bench/gemm_q4_bench.py run --modules .gpu/q4 --json "$out/gemm_q4_h200.json" 2>&1 | tail -30 || echo "gemm exit $?"
fi
tiny=$(ls -d .gpu/q4tiny* 2>/dev/null | head -1)
if [ -n "$tiny" ]; then
  python3 $here/tiny_q4.py check --dir "$tiny" --json "$out/tiny_q4_h200.json" 2>&1 | tail -5 || echo "tiny exit $?"
fi
if [ -d .gpu/demo-mlx4-sm_80 ]; then
  arms=(--arm bf16 .gpu/demo-u16r-sm_80 models/demo/target --arm mlx4 .gpu/demo-mlx4-sm_80 .gpu/demo-mlx4-target)
  [ -d .gpu/demo-ct4-sm_80 ] && arms+=(--arm ct4 .gpu/demo-ct4-sm_80 .gpu/demo-ct4-target)
  python3 $here/demo_q4.py --device cuda "${arms[@]}" --json "$out/demo_q4_h200.json" 2>&1 | tail -8 || echo "demo exit $?"
fi
if [ -d .gpu/8b-q4-b16-sm_80 ]; then
  python3 $here/run_8b.py --profile --json "$out/q4_8b_h200.json" 2>&1 | tail -30 || echo "8b exit $?"
fi
