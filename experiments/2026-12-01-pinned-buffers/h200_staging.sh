#!/bin/bash
# Device call (the `run` tool, nvidia-h200) for the runtime's pinned argument and result buffers
# (runtime/module.py Staging) with plain decoding one step ahead: exactness of the tiny and demo pairs
# through the engine, then both 8B blocks with peers, profile and the host time of a step. Results go
# to $OUT. Carry .gpu/site.zip and .gpu/artifacts.zip, made here by
#   python bench/pack_runtime.py --artifacts 8b-b16-sm_80 8b-b8-sm_80 tiny tiny-sm_80 demo-sm_80 expected.json
mkdir -p /tmp/site && python3 -m zipfile -e .gpu/site.zip /tmp/site && python3 -m zipfile -e .gpu/artifacts.zip .gpu
export PYTHONPATH=/tmp/site:. PYTHONUNBUFFERED=1
timeout 150 python3 bench/gpu_check.py run --device cuda --arch sm_80 --json "$OUT/gpu_check_h200_staging.json" || exit 1
timeout 300 python3 bench/speed_8b.py run --profile --json "$OUT/speed_8b_h200_staging.json"
