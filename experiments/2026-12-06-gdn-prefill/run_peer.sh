#!/bin/bash
# Issue 26, call 3: the 27B pair of this folder (prefill on the GDN step) and then, in a process of its
# own with ours freed, the torch peers of the same module on the same weights (eager, torch.compile
# reduce-overhead), as bench/speed_27b.py's docstring runs them.
#   here:   bench/pack_device.py wheels; bench/pack_device.py artifacts 27b-b16-pf-sm_80
#   device: bash experiments/2026-12-06-gdn-prefill/run_peer.sh   (the tree without models/ and kernels/objects)
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader
run() { timeout "$1" bash bench/on_device.sh "${@:2}" 2>&1 | grep -v Warning | tail -14; }
run 200 python3 bench/speed_27b.py run --artifact 27b-b16-pf-sm_80 --json "$OUT/speed_27b_pf2.json"
run 330 python3 bench/speed_27b.py peer --artifact 27b-b16-pf-sm_80 --json "$OUT/speed_27b_peer.json"
exit 0
