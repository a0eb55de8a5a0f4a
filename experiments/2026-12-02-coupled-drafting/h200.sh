#!/bin/bash
# One device call (the `run` tool, nvidia-h200) for coupled drafting (issue #23): exactness from the
# installed wheels (bench/gpu_check.py: the tiny pair == eager, greedy and seeded T=1, whose drafts
# are coupled; the demo pair drafted == exact plain), then the demo pair's coupled, greedy and
# other-noise drafts alternated (bench/coupled_drafting.py compiled) at T = 0.6 and 1.0, and at
# T = 1 with top-p 0.9; the same at T = 1 for the build whose drafts range over the drafter's own
# top-k / top-p kept set (DRAFT_CUT = True, demo-cut-sm_80), for what that cut costs a round.
# Made here by
#   python bench/gpu_check.py prepare --arch sm_80            # DRAFT_CUT = False (the shipped choice)
#   (DRAFT_CUT = True) python bench/gpu_check.py prepare --arch sm_80; mv .gpu/demo-sm_80 .gpu/demo-cut-sm_80
#   make device-wheels; make device-artifacts NAMES="tiny tiny-sm_80 demo-sm_80 demo-cut-sm_80 expected.json"
# and carried as [".gpu/wheels", ".gpu/artifacts.zip"]. The first call (h200_cut.log) ran the cut
# build only, as demo-sm_80, and its gpu_check found no tiny checkpoints (not packed).
set -uo pipefail

nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
timeout 200 bash bench/on_device.sh python3 bench/gpu_check.py run --device cuda --arch sm_80 --json "$OUT/gpu_check_h200.json" || echo "gpu_check failed: $?"
bench() {  # artifacts, result name, options
  local arts=$1 name=$2; shift 2
  timeout 170 bash bench/on_device.sh python3 bench/coupled_drafting.py compiled --artifacts ".gpu/$arts" --device cuda \
      "$@" --json "$OUT/$name.json" 2>&1 | grep -v "prompt [0-9]*/" || echo "coupled_drafting $name failed"
}
bench demo-sm_80 coupled_h200 --temperatures 0.6,1.0
bench demo-sm_80 coupled_h200_topp09 --temperatures 1.0 --top-p 0.9
bench demo-cut-sm_80 coupled_h200_cut_again --temperatures 1.0
