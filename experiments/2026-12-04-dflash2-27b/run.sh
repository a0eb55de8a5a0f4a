#!/bin/bash
# Issue 27 at the Qwen3.6-27B DFlash2 example's shape on a GPU (one `run` call):
#   here:   bench/compile_from_config.py --target tests/fixtures/qwen3.5-27b --drafter
#           tests/fixtures/qwen3.6-27b-dflash2 --archs sm_80 gfx1151 --keep .gpu/27b-d2 --json compile_27b_dflash2.json
#           bench/compile_from_config.py ... --drafter tests/fixtures/qwen3.6-27b-dflash-v1 --archs sm_80 --keep .gpu/27b-v1
#           bench/pack_device.py wheels; bench/pack_device.py artifacts 27b-d2-sm_80 27b-v1-sm_80
#   device: bash experiments/2026-12-04-dflash2-27b/run.sh   (carry .gpu/wheels, .gpu/artifacts.zip)
# The first run (draft_step_27b_2065keys.json, H200) had the ring's 2065 keys; the second
# (draft_step_27b.json) the ring padded to 2112 (export/draft_window.py KEY_ALIGN) and the
# selector's span, with 2 rounds to fit what was left of the session's device time. On an 80 GB H100
# each artifact runs in its own process (two binds of the target do not fit), and the report merges them.
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
mib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
if [ "$mib" -gt 100000 ]; then  # an H200: both artifacts in one process
  timeout 270 bash bench/on_device.sh python3 bench/draft_step.py run --artifacts 27b-d2-sm_80 27b-v1-sm_80 \
      --json "$OUT/draft_step_27b.json" --rounds 2 --n 15 2>&1 | grep -v Warning | tail -8
  PYTHONPATH=/tmp/site python3 bench/draft_step.py report "$OUT/draft_step_27b.json"
else  # an 80 GB H100 holds one artifact's copy of the 54 GB target: one process each, one after the other
  for a in 27b-d2-sm_80 27b-v1-sm_80; do
    timeout 200 bash bench/on_device.sh python3 bench/draft_step.py run --artifacts $a \
        --json "$OUT/draft_step_27b_$a.json" --rounds 2 --n 15 2>&1 | grep -v Warning | tail -6
  done
  PYTHONPATH=/tmp/site python3 bench/draft_step.py report "$OUT"/draft_step_27b_27b-d2-sm_80.json \
      "$OUT"/draft_step_27b_27b-v1-sm_80.json
fi
