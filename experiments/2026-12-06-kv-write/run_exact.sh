#!/bin/bash
# On the H200, one call (bash bench/on_device.sh bash experiments/2026-12-06-kv-write/run_exact.sh): the
# build `make compile` makes now (the KV cache write inside the norm + rope dispatch, 8 decode steps a call)
# 1. bench/gpu_check.py: the tiny float32 pair compiled for sm_80 against eager tokens (greedy and
#    T = 1, prompts of 1 to 150 tokens), the demo pair drafted == plain greedy and at T = 1, its speed;
# 2. bench/row_invariance_check.py on the demo target: decode's logits row against verify's, bit for
#    bit, with the planted control (another k split at M = 1) that must part.
set -uo pipefail
out=${OUT:-/tmp/out}
python3 bench/gpu_check.py run --device cuda --json "$out/gpu_check_h200.json" 2>&1 | tail -14 || echo "gpu_check exit $?"
python3 bench/row_invariance_check.py run --json "$out/row_invariance_demo_h200.json" 2>&1 | tail -14 || echo "rows exit $?"
