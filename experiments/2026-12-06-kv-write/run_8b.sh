#!/bin/bash
# On the H200 (or an H100: the results are named by the card), one call (bash bench/on_device.sh bash experiments/2026-12-06-kv-write/run_8b.sh), the 8B
# shape at block 16 with random bf16 weights (bench/speed_8b.py):
# 1. the KV cache write inside the norm + rope dispatch (dflash_norm_rope2_kv) with 8 decode steps a call
#    (.gpu/8b-b16kv8-sm_80, the build `make compile` makes now) against the build before
#    (.gpu/8b-b16pre-sm_80: 4 steps a call, IREE's copy + scatter), alternated three times in one
#    process, torch.compile reduce-overhead beside them, this build's kernels and the peer's (CUPTI),
#    and torch's reasons for any CUDA graph it skips (TORCH_LOGS=perf_hints, in kv8.log);
# 2. 8 steps alone (.gpu/8b-b16k8-sm_80) against the build before (no peers).
set -uo pipefail
export TORCH_LOGS=perf_hints
out=${OUT:-/tmp/out}
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv > "$out/gpu.csv" 2>&1
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | grep -o 'H[0-9][0-9]*' | head -1 || echo gpu)  # H200 or H100
gpu=${gpu,,}
python3 bench/speed_8b.py run --arch sm_80 --blocks 16 --variant kv8 --against pre --rounds 3 \
    --peers reduce-overhead --profile --json "$out/speed_8b_kv8_$gpu.json" > "$out/kv8_$gpu.log" 2>&1 || echo "kv8 exit $?"
tail -30 "$out/kv8_$gpu.log"; grep -i "skipping cudagraph\|cudagraph" "$out/kv8_$gpu.log" | head -5
python3 bench/speed_8b.py run --arch sm_80 --blocks 16 --variant k8 --against pre --rounds 2 \
    --no-peers --json "$out/speed_8b_k8_$gpu.json" 2>&1 | tail -8 || echo "k8 exit $?"
