#!/bin/bash
# Issue 26: the Qwen3.5-27B pair (block 16, DFlash v1 fixture) on one GPU, with the hybrid kernels
# (gated attention, zero-centred norm + partial rope, GDN step: "kern") and as IREE lowered it before
# them ("before"); then the torch peers in a process of their own (nothing of ours loaded).
#   here:   bench/compile_from_config.py --target tests/fixtures/qwen3.5-27b --drafter
#           tests/fixtures/qwen3.5-27b-dflash --archs sm_80 --keep .gpu/27b-b16        (at 5826583: before)
#           ... --keep .gpu/27b-b16-kern                                                 (at f1e0580: kern)
#           bench/pack_device.py wheels; bench/pack_device.py artifacts 27b-b16-kern-sm_80 27b-b16-sm_80
#   device: bash experiments/2026-12-05-hybrid-27b-speed/run.sh kern    (carry .gpu/wheels, .gpu/artifacts.zip)
#           bash experiments/2026-12-05-hybrid-27b-speed/run.sh before
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
run() { timeout "$1" bash bench/on_device.sh "${@:2}" 2>&1 | grep -v Warning | tail -45; }
if [ "$1" = kern ]; then
  run 300 python3 bench/speed_27b.py run --artifact 27b-b16-kern-sm_80 --json "$OUT/speed_27b_kern.json" --profile
  run 260 python3 bench/speed_27b.py peer --artifact 27b-b16-kern-sm_80 --json "$OUT/speed_27b_peer.json"
else
  run 300 python3 bench/speed_27b.py run --artifact 27b-b16-sm_80 --json "$OUT/speed_27b_before.json" --profile
fi
