#!/bin/bash
# run_device.sh cut to what ~200 s of device time holds (the session's device time was nearly spent
# on refused starts): run 2 of q4_pipe.py, one round of the argmax A/B with its profile, the attention
# variants. Same host steps and carry as run_device.sh:
#   bash bench/on_device.sh bash experiments/2026-12-07-argmax/run_short.sh
set -uo pipefail
out=${OUT:-/tmp/out}
(cd .gpu && python3 -m zipfile -e ptx.zip .)
card=$(python3 -c "import torch; n = torch.cuda.get_device_name(0); print('h200' if 'H200' in n else 'h100' if 'H100' in n else 'gpu')")
t0=$(date +%s)
step() { echo "== $1 ($(( $(date +%s) - t0 )) s)"; }
step "4-bit GEMM, x in shared memory (q4_pipe run 2)"
timeout 90 bash experiments/2026-12-07-q4-pipeline/run_device.sh .gpu/q4xsm q4_xsm
step "the 8B at bf16: two-level argmax (am) against the build before (base), one round"
ln -sfn 8b-b16-sm_80 .gpu/8b-b16base-sm_80
timeout 110 python3 bench/speed_8b.py run --blocks 16 --variant am --against base --rounds 1 --profile --no-peers \
  --json "$out/speed_8b_am_$card.json" 2>&1 | grep -v Warning | tail -24
step "decode-shaped attention variants"
timeout 60 python3 experiments/2026-12-07-decode-attention/attn_raw.py run --dir .gpu/attn --json "$out/attn_raw_$card.json" 2>&1 | grep -v Warning | tail -12
step "end"
