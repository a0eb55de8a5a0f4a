#!/bin/bash
# On the H200, one call (bash bench/on_device.sh bash experiments/2026-12-06-kv-write/run_8b.sh), the 8B
# shape at block 16 with random bf16 weights (bench/speed_8b.py):
# 1. the KV cache write inside the norm + rope dispatch (dflash_norm_rope2_kv) with 8 decode steps a call
#    (.gpu/8b-b16kv8-sm_80, the build `make compile` makes now) against the build before
#    (.gpu/8b-b16pre-sm_80: 4 steps a call, IREE's copy + scatter), alternated three times in one
#    process, torch.compile reduce-overhead beside them, and this build's kernels (CUPTI);
# 2. 8 steps alone (.gpu/8b-b16k8-sm_80) against the build before (no peers).
set -uo pipefail
out=${OUT:-/tmp/out}
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv > "$out/gpu.csv" 2>&1
python3 bench/speed_8b.py run --arch sm_80 --blocks 16 --variant kv8 --against pre --rounds 3 \
    --peers reduce-overhead --profile --json "$out/speed_8b_kv8_h200.json" 2>&1 | tail -24 || echo "kv8 exit $?"
python3 bench/speed_8b.py run --arch sm_80 --blocks 16 --variant k8 --against pre --rounds 2 \
    --no-peers --json "$out/speed_8b_k8_h200.json" 2>&1 | tail -8 || echo "k8 exit $?"
