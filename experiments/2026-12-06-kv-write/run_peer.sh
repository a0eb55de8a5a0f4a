#!/bin/bash
# On the H200 (or an H100), one call (bash bench/on_device.sh bash experiments/2026-12-06-kv-write/run_peer.sh):
# the 8B shape at block 16, this build (.gpu/8b-b16kv8-sm_80) beside torch.compile reduce-overhead of
# the eager Qwen3 module, now that the module takes the export path only under torch.export
# (export/ops.py `exporting`): torch 2.11's dynamo answered torch.compiler.is_exporting() True under
# torch.compile, so earlier peers compiled the named ops' references (the first run_8b.sh run's perf
# hints, the peer's profile in speed_8b_kv8_h100.json). No profile (the session's device time was short); torch's CUDA graph skips.
set -uo pipefail
export TORCH_LOGS=perf_hints
out=${OUT:-/tmp/out}
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv > "$out/gpu.csv" 2>&1
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | grep -o 'H[0-9][0-9]*' | head -1 || echo gpu)
gpu=${gpu,,}
python3 bench/speed_8b.py run --arch sm_80 --blocks 16 --variant kv8 --peers reduce-overhead \
    --json "$out/speed_8b_peer_$gpu.json" > "$out/peer_$gpu.log" 2>&1 || echo "peer exit $?"
grep -v "perf_hints\] Using FallbackKernel" "$out/peer_$gpu.log" | tail -32; grep -c "FallbackKernel: torch.ops.dflash" "$out/peer_$gpu.log"
