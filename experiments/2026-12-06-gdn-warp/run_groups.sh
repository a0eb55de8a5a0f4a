#!/bin/bash
# Issue 26, the second call: the GDN step with 16 row groups (4 warps of 8 columns a workgroup,
# 3,072 warps at the 27B shape; this commit) against the object before the warp-shuffle one and a
# variant that writes the last row's state only (what the rollback's writes cost), bits and time at the 27B layer shape, beside IREE's own lowering.
#   here:   bench/gdn_check.py prepare --arch sm_80 --iree                     (.gpu/gdn: this commit)
#           bench/gdn_check.py prepare --arch sm_80 --objects .gpu/gdn-base-objects --out .gpu/gdn-base
#           clang-19 ... -DGD_EVERY_ROW=0 gdn_gpu.cu -o .gpu/gdn-last-objects/gdn_sm_80.ptx (kernels/build.py's sm_80 command)
#           bench/gdn_check.py prepare --arch sm_80 --objects .gpu/gdn-last-objects --out .gpu/gdn-last
#           bench/gpu_check.py prepare --arch sm_80 --pair qwen35           (the hybrid pairs with this kernel)
#           bench/pack_device.py artifacts gdn gdn-base gdn-last 27b-b16-g16-sm_80 tiny35 tiny35-sm_80 \
#               demo35-sm_80 expected35.json
#   device: bash experiments/2026-12-06-gdn-warp/run_groups.sh   (the tree with models/demo-qwen35,
#           without kernels/objects and models/demo, for the 64 MiB carry)
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader
run() { timeout "$1" bash bench/on_device.sh "${@:2}" 2>&1 | grep -v Warning | tail -12; }
# in the order of what matters most; the warp-shuffle object was timed in the first call (run.sh),
# and the 2k prefill (the GDN step is not in it) too
run 90 python3 bench/gdn_check.py run --json "$OUT/gdn_check_groups.json"
run 150 python3 bench/gpu_check.py run --pair qwen35 --arch sm_80 --runs 1 --json "$OUT/gpu_check_qwen35_g16.json"
[ -d .gpu/27b-b16-g16-sm_80 ] && run 200 python3 bench/speed_27b.py run --artifact 27b-b16-g16-sm_80 --json "$OUT/speed_27b_g16.json" --profile --prefill 0
run 60 python3 bench/gdn_check.py run --dir .gpu/gdn-last --json "$OUT/gdn_check_last_only.json"   # states unchecked: time only
run 60 python3 bench/gdn_check.py run --dir .gpu/gdn-base --json "$OUT/gdn_check_base2.json"
if command -v ncu > /dev/null; then
  timeout 60 bash bench/on_device.sh ncu --kernel-name regex:dflash_gdn --launch-skip 2 --launch-count 1 \
    --section SpeedOfLight --section WarpStateStats --section MemoryWorkloadAnalysis --section Occupancy \
    python3 experiments/2026-12-06-gdn-warp/ncu_t16.py .gpu/gdn > "$OUT/ncu_t16_gdn_g16.txt" 2>&1
  grep -E "Duration|Throughput|Stall|Warp Cycles|Achieved Occupancy" "$OUT/ncu_t16_gdn_g16.txt" | head -20
fi
exit 0
