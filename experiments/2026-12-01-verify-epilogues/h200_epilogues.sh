#!/bin/bash
# Device call (the `run` tool, nvidia-h200) for the verify step's fewer dispatches: GEMM epilogues (the
# residual add, silu(gate) * up) and the block attention in the model's layout (kernels/). Checks the
# epilogue kernels against the plain ones and the tiny and demo pairs' exactness, then both 8B blocks
# of the build before (variant "pre") and of this build, one process after the other, the second with
# peers and profile. Results go to $OUT. Carry .gpu/site.zip and .gpu/artifacts.zip, made here by
#   python bench/pack_runtime.py --artifacts 8b-b16-sm_80 8b-b8-sm_80 8b-b16pre-sm_80 8b-b8pre-sm_80 \
#       tiny tiny-sm_80 demo-sm_80 groups expected.json
mkdir -p /tmp/site && python3 -m zipfile -e .gpu/site.zip /tmp/site && python3 -m zipfile -e .gpu/artifacts.zip .gpu
export PYTHONPATH=/tmp/site:. PYTHONUNBUFFERED=1
timeout 90 python3 bench/gemm_bench.py run --groups --modules .gpu/groups --json "$OUT/gemm_h200_epilogues.json"
timeout 120 python3 bench/gpu_check.py run --device cuda --arch sm_80 --json "$OUT/gpu_check_h200_epilogues.json" || exit 1
timeout 120 python3 bench/speed_8b.py run --variant pre --no-peers --json "$OUT/speed_8b_h200_epilogues_pre.json"
timeout 250 python3 bench/speed_8b.py run --profile --json "$OUT/speed_8b_h200_epilogues.json"
