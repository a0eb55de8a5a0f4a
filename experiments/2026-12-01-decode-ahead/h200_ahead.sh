#!/bin/bash
# Device call (the `run` tool, nvidia-h200) for plain decoding one step ahead of the host
# (CompiledPair.decode_ahead, which Engine.generate uses for plain decoding) and the host time of a
# step (speed_8b.py's `issue`). Results go to $OUT. Carry .gpu/site.zip and .gpu/artifacts.zip, made by
#   python bench/pack_runtime.py --artifacts 8b-b16-sm_80 8b-b8-sm_80 tiny tiny-sm_80 demo-sm_80 expected.json
mkdir -p /tmp/site && python3 -m zipfile -e .gpu/site.zip /tmp/site && python3 -m zipfile -e .gpu/artifacts.zip .gpu
export PYTHONPATH=/tmp/site:. PYTHONUNBUFFERED=1
python3 bench/gpu_check.py run --device cuda --arch sm_80 --json "$OUT/gpu_check_h200_ahead.json"
python3 bench/speed_8b.py run --profile --json "$OUT/speed_8b_h200_ahead.json"
