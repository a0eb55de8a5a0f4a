#!/bin/bash
# Issue 26, one `run` call on the GPU: the GDN step with the warp-shuffle row loop (d47755a) against
# the object committed before it, bits and time at the 27B layer shape, beside IREE's own lowering
# of the eager rule; then the norm + rope f32 variant's check rerun (the bound of c09cdac); the
# Qwen3.5-27B pair built with this kernel and the one-gather conv windows (7e23093) timed as
# experiments/2026-12-05-hybrid-27b-speed/ timed the build before (the rollback's share of a round,
# and now the 2k prefill's kernel profile); the hybrid pairs' exactness again (bench/gpu_check.py
# --pair qwen35); and an Nsight Compute look at the T = 16 call of each GDN object.
#   here:   bench/gdn_check.py prepare --arch sm_80 --iree
#           git show <commit before>:kernels/objects/gdn_sm_80.ptx > .gpu/gdn-base-objects/gdn_sm_80.ptx
#           bench/gdn_check.py prepare --arch sm_80 --objects .gpu/gdn-base-objects --out .gpu/gdn-base
#           bench/norm_rope_check.py prepare --arch sm_80; bench/gpu_check.py prepare --arch sm_80 --pair qwen35
#           bench/compile_from_config.py --target tests/fixtures/qwen3.5-27b --drafter \
#               tests/fixtures/qwen3.5-27b-dflash --archs sm_80 --keep .gpu/27b-b16-conv
#           bench/pack_device.py wheels; bench/pack_device.py artifacts gdn gdn-base norm_rope 27b-b16-conv-sm_80 \
#               tiny35 tiny35-sm_80 demo35-sm_80 expected35.json
#   device: bash experiments/2026-12-06-gdn-warp/run.sh   (carry .gpu/wheels, .gpu/artifacts.zip; the tree
#           with models/demo-qwen35, without kernels/objects and models/demo, for the 64 MiB carry)
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader
run() { timeout "$1" bash bench/on_device.sh "${@:2}" 2>&1 | grep -v Warning | tail -12; }
# in the order of what matters most, in case the call is cut short
run 90 python3 bench/gdn_check.py run --json "$OUT/gdn_check_warp.json"
[ -d .gpu/27b-b16-conv-sm_80 ] && run 240 python3 bench/speed_27b.py run --artifact 27b-b16-conv-sm_80 --json "$OUT/speed_27b_conv.json" --profile
run 150 python3 bench/gpu_check.py run --pair qwen35 --arch sm_80 --runs 1 --json "$OUT/gpu_check_qwen35.json"
run 60 python3 bench/norm_rope_check.py run --json "$OUT/norm_rope.json"
run 60 python3 bench/gdn_check.py run --dir .gpu/gdn-base --json "$OUT/gdn_check_base.json"
if command -v ncu > /dev/null; then
  for v in gdn gdn-base; do
    timeout 60 bash bench/on_device.sh ncu --kernel-name regex:dflash_gdn --launch-skip 2 --launch-count 1 \
      --section SpeedOfLight --section WarpStateStats --section MemoryWorkloadAnalysis \
      python3 experiments/2026-12-06-gdn-warp/ncu_t16.py .gpu/$v > "$OUT/ncu_t16_$v.txt" 2>&1
    grep -E "Duration|Throughput|Stall|Warp Cycles|Achieved Occupancy" "$OUT/ncu_t16_$v.txt" | head -20
  done
else
  echo "no ncu"
fi
