#!/bin/bash
# Device call (the `run` tool, nvidia-h200): where the host time of a decode and a verify step goes.
# The 8B block-16 build with --profile, which adds the host's timeline from CUPTI's driver-API records
# (bench/speed_8b.py `_host_timeline`): synchronous decode and verify calls (and one step's chrome
# trace of each), the same steps invoked on arguments staged once, and plain decoding's steps in a
# row; then the CUDA HAL's stream-ordered allocations off and on, in alternating processes. Carry
# .gpu/site.zip and .gpu/artifacts.zip, made here by
#   python bench/pack_runtime.py --artifacts 8b-b16-sm_80
mkdir -p /tmp/site && python3 -m zipfile -e .gpu/site.zip /tmp/site && python3 -m zipfile -e .gpu/artifacts.zip .gpu
export PYTHONPATH=/tmp/site:. PYTHONUNBUFFERED=1
timeout 240 python3 bench/speed_8b.py run --blocks 16 --no-peers --profile --traces "$OUT" \
    --json "$OUT/speed_8b_h200_host_timeline.json"
for i in 1 2; do
  timeout 100 python3 bench/speed_8b.py run --blocks 16 --no-peers --json "$OUT/speed_8b_h200_async_alloc_$i.json"
  timeout 100 python3 bench/speed_8b.py run --blocks 16 --no-peers --runtime-flag=--cuda_async_allocations=false \
      --json "$OUT/speed_8b_h200_sync_alloc_$i.json"
done
