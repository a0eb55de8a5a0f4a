#!/bin/bash
# On the H200 (or an H100), one call: the 4-bit GEMM variants of q4_pipe.py built into DIR (run 1:
# .gpu/q4pipe, results q4_pipe_<card>.json; run 2, not yet run: .gpu/q4xsm, q4_xsm_<card>.json), carried:
#   bash experiments/2026-12-07-q4-pipeline/run_device.sh [DIR NAME]
set -uo pipefail
out=${OUT:-/tmp/out}
dir=${1:-.gpu/q4pipe}
name=${2:-q4_pipe}
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv > "$out/gpu.csv" 2>&1
python3 -c "import cupy" 2>/dev/null || echo "no cupy"
card=$(python3 -c "import torch; n = torch.cuda.get_device_name(0); print('h200' if 'H200' in n else 'h100' if 'H100' in n else 'gpu')")
python3 experiments/2026-12-07-q4-pipeline/q4_pipe.py run --dir "$dir" --json "$out/${name}_$card.json" 2>&1 | grep -v "^bits" | tail -60
python3 - "$out/${name}_$card.json" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
bad = [b for b in d["bits"] if b["differ_vs_bf16_kernel"] or b["row5_M16_vs_M1_differ"]]
print("bits checks", len(d["bits"]), "failing", len(bad), bad[:6])
PY
