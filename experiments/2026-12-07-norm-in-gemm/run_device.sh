#!/bin/bash
# On the H200 (or an H100): the RMSNorm after each residual add folded into the residual GEMM's dispatch
# at decode (export/qwen3.py `project_residual_norm`, kernels/gemm residual_norm epilogue), against the
# build before it, and the row checks. Host steps: bench/speed_8b.py prepare --arch sm_80 --blocks 16
# --variant nf (this tree) and --variant pre (a worktree of the commit before, PYTHONPATH set to it);
# bench/row_invariance_check.py prepare --arch sm_80 --models demo 8b --builds row-invariant planted-split;
# bench/gpu_check.py prepare --arch sm_80; bench/pack_device.py wheels and artifacts of those folders.
# PART=8b (carry [".gpu/wheels", ".gpu/artifacts.zip"], models/demo's target moved out of the tree: the
# 8B steps and the 8B row check), PART=demo (models/demo in the tree: the demo pair's row check,
# drafted == plain and the tiny float32 pair) or PART=all (both, in that order: models/demo's target and
# drafter in the tree, the other archs' kernel objects out of it, to fit the 64 MiB carry):
#   PART=8b bash bench/on_device.sh bash experiments/2026-12-07-norm-in-gemm/run_device.sh
# The tree: 3df3f79 with norm.patch applied (git apply) and `make kernels`. Run 1 was PART=8b with the
# patch's first form of gm_rms_row (README.md), run 2 PART=all; their files are renamed *_run{1,2}_*.
set -uo pipefail
out=${OUT:-/tmp/out}
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv > "$out/gpu_$PART.csv" 2>&1
card=$(python3 -c "import torch; n = torch.cuda.get_device_name(0); print('h200' if 'H200' in n else 'h100' if 'H100' in n else 'gpu')")
t0=$(date +%s)
step() { echo "== $1 ($(( $(date +%s) - t0 )) s)"; }
# LIMIT: the seconds this call may run: a part whose timeout no longer fits is skipped, not cut off unwritten.
fits() { [ $(( ${LIMIT:-570} - ($(date +%s) - t0) )) -ge "$1" ] || { echo "(skipped: $1 s no longer fit)"; false; }; }
if [ "$PART" != demo ]; then
  step "the 8B at bf16: the norm in the GEMM (nf) against the build before (pre), alternated, with the profile"
  fits 260 && timeout 260 python3 bench/speed_8b.py run --blocks 16 --variant nf --against pre --rounds 3 --profile \
    --no-peers --json "$out/speed_8b_nf_$card.json" 2>&1 | grep -v Warning | tail -30
  step "the 8B's decode logits row against verify's, bit for bit (and the planted control)"
  python3 - <<'PY'
import json, shutil; p = ".gpu/rows-sm_80/meta.json"; shutil.copy(p, p + ".all")
m = json.load(open(p)); m["models"].pop("demo", None); json.dump(m, open(p, "w"))
PY
  fits 200 && timeout 200 python3 bench/row_invariance_check.py run --json "$out/row_invariance_8b_$card.json" 2>&1 | tail -6
  [ -f .gpu/rows-sm_80/meta.json.all ] && mv .gpu/rows-sm_80/meta.json.all .gpu/rows-sm_80/meta.json
fi
if [ "$PART" != 8b ]; then
  step "the demo pair's decode logits row against verify's (and the planted control)"
  python3 - <<'PY'
import json; p = ".gpu/rows-sm_80/meta.json"; m = json.load(open(p)); m["models"].pop("8b", None); json.dump(m, open(p, "w"))
PY
  fits 90 && timeout 90 python3 bench/row_invariance_check.py run --json "$out/row_invariance_demo_$card.json" 2>&1 | tail -6
  step "the demo pair drafted == plain, and the tiny float32 pair against eager"
  fits 300 && timeout 300 python3 bench/gpu_check.py run --device cuda --prompts 16 --runs 1 --json "$out/gpu_check_$card.json" 2>&1 | tail -20
fi
step "end"
