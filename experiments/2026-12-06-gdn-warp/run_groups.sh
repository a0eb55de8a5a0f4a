#!/bin/bash
# Issue 26, the second call: the GDN step with 16 row groups (4 warps of 8 columns a workgroup,
# 3,072 warps at the 27B shape; this commit) against the object before the warp-shuffle one and a
# variant that writes the last row's state only (what the rollback's writes cost), bits and time at the 27B layer shape, beside IREE's own lowering.
#   here:   bench/gdn_check.py prepare --arch sm_80 --iree                     (.gpu/gdn: this commit)
#           bench/gdn_check.py prepare --arch sm_80 --objects .gpu/gdn-base-objects --out .gpu/gdn-base
#           clang-19 ... -DGD_EVERY_ROW=0 gdn_gpu.cu -o .gpu/gdn-last-objects/gdn_sm_80.ptx (kernels/build.py's sm_80 command)
#           bench/gdn_check.py prepare --arch sm_80 --objects .gpu/gdn-last-objects --out .gpu/gdn-last
#           bench/pack_device.py artifacts gdn gdn-base gdn-last 27b-b16-g16-sm_80
#   device: bash experiments/2026-12-06-gdn-warp/run_groups.sh
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader
run() { timeout "$1" bash bench/on_device.sh "${@:2}" 2>&1 | grep -v Warning | tail -12; }
# in the order of what matters most; the warp-shuffle object was timed in the first call (run.sh),
# and the 2k prefill (the GDN step is not in it) too
run 90 python3 bench/gdn_check.py run --json "$OUT/gdn_check_groups.json"
[ -d .gpu/27b-b16-g16-sm_80 ] && run 200 python3 bench/speed_27b.py run --artifact 27b-b16-g16-sm_80 --json "$OUT/speed_27b_g16.json" --profile --prefill 0
run 60 python3 bench/gdn_check.py run --dir .gpu/gdn-last --json "$OUT/gdn_check_last_only.json"   # states unchecked: time only
run 60 python3 bench/gdn_check.py run --dir .gpu/gdn-base --json "$OUT/gdn_check_base2.json"
exit 0
