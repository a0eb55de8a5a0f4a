#!/bin/bash
# On the H200 (or an H100), one call: decode's RMSNorm in the next GEMM's prologue (kernels/gemm
# dflash_gemm3_norm_mt1, dflash_swiglu_norm_mt1; verify's rows the norm's own dispatch, dflash_rms_norm)
# against the build before it, and the row checks. Host steps: probe.py build --out .gpu/nprobe;
# bench/speed_8b.py prepare --arch sm_80 --blocks 16 --variant np (this tree; `pre`, the build before, is
# .gpu/8b-b16pre-sm_80 of 3df3f79, whose product code HEAD f41a583 still is); bench/row_invariance_check.py
# prepare --arch sm_80 --models demo 8b --builds row-invariant planted-split; bench/gpu_check.py prepare
# --arch sm_80; bench/pack_device.py wheels and artifacts of those folders and nprobe (the rows' .mlirbc
# left out). Carry [".gpu/wheels", ".gpu/artifacts.zip"], models/demo's target and drafter in the tree,
# models/demo-qwen35, models/demo/{drafter-b16, drafter2} and kernels/objects/* out of it (the 64 MiB carry):
#   bash bench/on_device.sh bash experiments/2026-12-07-norm-prologue/run_device.sh
set -uo pipefail
out=${OUT:-/tmp/out}
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv > "$out/gpu.csv" 2>&1
card=$(python3 -c "import torch; n = torch.cuda.get_device_name(0); print('h200' if 'H200' in n else 'h100' if 'H100' in n else 'gpu')")
t0=$(date +%s)
step() { echo "== $1 ($(( $(date +%s) - t0 )) s)"; }
# LIMIT: the seconds this call may run (the device time left); a part that no longer fits is skipped.
fits() { [ $(( ${LIMIT:-570} - ($(date +%s) - t0) )) -ge "$1" ] || { echo "(skipped: $1 s no longer fit)"; false; }; }
step "the 8B at bf16: the norm in the GEMM's prologue (np) against the build before (pre), alternated, with the profile"
# with little device time left (LIMIT < 500), no profile: the rows' check must fit after it
prof=$([ "${LIMIT:-570}" -ge 500 ] && echo --profile)
fits 200 && timeout 230 python3 bench/speed_8b.py run --blocks 16 --variant np --against pre --rounds 3 $prof \
  --no-peers --json "$out/speed_8b_np_$card.json" 2>&1 | grep -v Warning | tail -30
step "decode's logits row against verify's, bit for bit, 8B and demo (and the planted control)"
fits 200 && timeout 200 python3 bench/row_invariance_check.py run --json "$out/row_invariance_$card.json" 2>&1 | tail -8
step "the demo pair drafted == plain, and the tiny float32 pair against eager"
fits 150 && timeout 150 python3 bench/gpu_check.py run --device cuda --prompts 16 --runs 1 --json "$out/gpu_check_$card.json" 2>&1 | tail -20
step "the prologue alone: its cost to the GEMM and its bits (CuPy)"
fits 60 && timeout 60 python3 experiments/2026-12-07-norm-prologue/probe.py run --dir .gpu/nprobe --json "$out/probe_$card.json" 2>&1 | tail -40
step "end"
