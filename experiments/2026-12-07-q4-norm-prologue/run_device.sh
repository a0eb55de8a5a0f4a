#!/bin/bash
# On the H200 (or an H100), one call: decode's RMSNorm in the packed 4-bit GEMM's prologue
# (dflash_q4gemm3_norm_mt1, dflash_q4swiglu_norm_mt1; verify's rows the norm's own dispatch) against the
# build before it. Host steps in README.md. Carry [".gpu/wheels", ".gpu/artifacts.zip"], models/demo's
# drafter in the tree (the rest of models/ and kernels/objects/* out of it: the 64 MiB carry):
#   LIMIT=540 bash bench/on_device.sh bash experiments/2026-12-07-q4-norm-prologue/run_device.sh
set -uo pipefail
out=${OUT:-/tmp/out}
here=experiments/2026-12-07-q4-norm-prologue
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv > "$out/gpu.csv" 2>&1
card=$(python3 -c "import torch; n = torch.cuda.get_device_name(0); print('h200' if 'H200' in n else 'h100' if 'H100' in n else 'gpu')")
t0=$(date +%s)
step() { echo "== $1 ($(( $(date +%s) - t0 )) s)"; }
fits() { [ $(( ${LIMIT:-570} - ($(date +%s) - t0) )) -ge "$1" ] || { echo "(skipped: $1 s no longer fit)"; false; }; }
step "the mlx-lm-written 4-bit demo target: decode's logits row against verify's, bit for bit (and the planted control)"
fits 60 && timeout 90 python3 bench/row_invariance_check.py run --json "$out/row_invariance_demo_mlx4_$card.json" 2>&1 | tail -4
step "the 8B shape at 4-bit: the norm prologue against the build before, alternated, with bf16 beside"
# with little device time left (LIMIT < 450), two rounds
rounds=$([ "${LIMIT:-570}" -ge 450 ] && echo 3 || echo 2)
fits 230 && timeout 330 python3 $here/run_8b.py --rounds $rounds --profile --json "$out/q4_8b_$card.json" 2>&1 \
  | grep -v Warning | tail -45
step "the 4-bit demo target with the bf16 drafter, the norm prologue against the build before: drafted == plain, tok/s"
fits 120 && timeout 150 python3 experiments/2026-12-03-q4-gpu/demo_q4.py --device cuda --rounds 2 \
  --arm np .gpu/demo-mlx4np-sm_80 .gpu/demo-mlx4-target --arm before .gpu/demo-mlx4pre-sm_80 .gpu/demo-mlx4-target \
  --json "$out/demo_q4_$card.json" 2>&1 | tail -8
step "end"
