#!/bin/bash
# Issue 26, call 2 of 2 on the GPU: the Qwen3.5-27B pair with a prefill's DeltaNet rule on the GDN step
# kernel (blocks of 16 rows, the last state only: this commit) against the build before it (c1edbaf's
# 16-group kernel, the prefill's rule IREE's chunked form), one process each, one after the other in one
# call: decode, verify(16), draft, a round, the 2k prefill, with the kernel profile.
#   here:   bench/compile_from_config.py --target tests/fixtures/qwen3.5-27b --drafter \
#               tests/fixtures/qwen3.5-27b-dflash --archs sm_80 --keep .gpu/27b-b16-pf   (and -g16 before)
#           bench/pack_device.py wheels; bench/pack_device.py artifacts 27b-b16-pf-sm_80 27b-b16-g16-sm_80
#   device: bash experiments/2026-12-06-gdn-prefill/run_27b.sh   (the tree without models/ and kernels/objects)
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader
run() { timeout "$1" bash bench/on_device.sh "${@:2}" 2>&1 | grep -v Warning | tail -14; }
run 280 python3 bench/speed_27b.py run --artifact 27b-b16-pf-sm_80 --json "$OUT/speed_27b_pf.json" --profile
run 280 python3 bench/speed_27b.py run --artifact 27b-b16-g16-sm_80 --json "$OUT/speed_27b_before.json" --profile
exit 0
