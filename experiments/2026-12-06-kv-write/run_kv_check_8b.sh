#!/bin/bash
# On the H200 (or an H100), one call (bash bench/on_device.sh bash experiments/2026-12-06-kv-write/run_kv_check_8b.sh):
# the KV-writing dispatch alone against the eager ops (bench/norm_rope_check.py, its KV cases among
# the rest; .gpu/norm_rope from `prepare --arch sm_80`), then run_8b.sh.
set -uo pipefail
out=${OUT:-/tmp/out}
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | grep -o 'H[0-9][0-9]*' | head -1 || echo gpu)
python3 bench/norm_rope_check.py run --json "$out/norm_rope_check_${gpu,,}.json" 2>&1 | grep -E "kv_|Error|error" | cut -c1-220
bash experiments/2026-12-06-kv-write/run_8b.sh
