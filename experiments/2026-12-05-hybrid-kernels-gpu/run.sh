#!/bin/bash
# Issue 26's exactness on a GPU, one `run` call: the three hybrid kernels bit-checked against their
# NumPy references, then the tiny float32 hybrid pair == eager and the demo-qwen35 pair's drafted ==
# exact plain and == default plain (bench/gpu_check.py --pair qwen35).
#   here:   bench/gdn_check.py prepare --arch sm_80; bench/attention_bench.py prepare-gated --arch sm_80
#           bench/norm_rope_check.py prepare --arch sm_80; bench/gpu_check.py prepare --arch sm_80 --pair qwen35
#           bench/pack_device.py wheels; bench/pack_device.py artifacts gdn attention-gated norm_rope tiny35 \
#               tiny35-sm_80 demo35-sm_80 expected35.json
#   device: bash experiments/2026-12-05-hybrid-kernels-gpu/run.sh   (carry .gpu/wheels, .gpu/artifacts.zip;
#           the tree with models/demo-qwen35)
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
run() { timeout "$1" bash bench/on_device.sh "${@:2}" 2>&1 | grep -v Warning | tail -25; }
# in the order of what matters most, in case the call is cut short
run 70 python3 bench/gdn_check.py run --json "$OUT/gdn_check.json"
run 250 python3 bench/gpu_check.py run --pair qwen35 --arch sm_80 --runs 1 --json "$OUT/gpu_check_qwen35.json"
run 110 python3 bench/attention_bench.py run-gated --arch sm_80 --json "$OUT/attention_gated.json"
run 70 python3 bench/norm_rope_check.py run --json "$OUT/norm_rope.json"
