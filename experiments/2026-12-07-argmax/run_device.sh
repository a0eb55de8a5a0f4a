#!/bin/bash
# On the H200 (or an H100), one call for three experiments, in the order of what matters most in case
# the call is cut short. Host steps: `git apply experiments/2026-12-07-argmax/argmax.patch`, bench/speed_8b.py
# prepare --blocks 16 --variant am (the two-level argmax), the patch reverted, beside .gpu/8b-b16-sm_80 (the tree without it); 8b-q4-b16-sm_80 and the variants
# of experiments/2026-12-07-q4-pipeline/run_xsm.sh; attn_raw.py build (experiments/2026-12-07-decode-attention/);
# bench/pack_device.py wheels, artifacts 8b-q4-b16-sm_80 8b-b16-sm_80 8b-b16am-sm_80
# tiny tiny-sm_80 expected.json; (cd .gpu && zip -r ptx.zip q4xsm attn splits); .gpu/splits: the committed
# gemm_sm_80.ptx and a variants.json of k splits (6144x4096 1,2,4; 4096x4096 2,4,8; 4096x12288 2,3,4,6).
# Carry [".gpu/wheels", ".gpu/artifacts.zip", ".gpu/ptx.zip"]:
#   bash bench/on_device.sh bash experiments/2026-12-07-argmax/run_device.sh
set -uo pipefail
out=${OUT:-/tmp/out}
(cd .gpu && python3 -m zipfile -e ptx.zip .)
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv > "$out/gpu.csv" 2>&1
card=$(python3 -c "import torch; n = torch.cuda.get_device_name(0); print('h200' if 'H200' in n else 'h100' if 'H100' in n else 'gpu')")
t0=$(date +%s)
step() { echo "== $1 ($(( $(date +%s) - t0 )) s)"; }
# LIMIT: the seconds this call may run (the run's limit, less the install): a part whose timeout no longer
# fits is skipped rather than cut off with its results unwritten.
fits() { [ $(( ${LIMIT:-570} - ($(date +%s) - t0) )) -ge "$1" ] || { echo "(skipped: $1 s no longer fit)"; false; }; }
step "4-bit GEMM, x in shared memory (q4_pipe run 2)"
fits 110 && timeout 110 bash experiments/2026-12-07-q4-pipeline/run_device.sh .gpu/q4xsm q4_xsm
step "the 8B at bf16: two-level argmax (am) against the build before (base), alternated"
ln -sfn 8b-b16-sm_80 .gpu/8b-b16base-sm_80
fits 200 && timeout 200 python3 bench/speed_8b.py run --blocks 16 --variant am --against base --rounds 3 --profile --no-peers \
  --json "$out/speed_8b_am_$card.json" 2>&1 | grep -v Warning | tail -24
step "the patch's tokens: the tiny float32 pair against eager, the demo pair drafted == plain, decode's logits row == verify's"
# (artifacts of `bench/gpu_check.py prepare --arch sm_80` and `bench/row_invariance_check.py prepare --arch sm_80
# --models demo`, built with argmax.patch applied, where present)
# (the demo pair's checks need models/demo, which the 64 MiB carry leaves out: then the tiny pair only)
only=$([ -d models/demo/target ] || echo --tiny-only)
[ -d .gpu/tiny-sm_80 ] && fits 120 && timeout 120 python3 bench/gpu_check.py run --device cuda $only --json "$out/gpu_check_am_$card.json" 2>&1 | tail -14
[ -d models/demo/target ] && [ -d .gpu/rows-sm_80 ] && fits 90 && timeout 90 python3 bench/row_invariance_check.py run --json "$out/row_invariance_am_$card.json" 2>&1 | tail -10
step "decode-shaped attention variants"
fits 100 && OUT=$out timeout 100 bash experiments/2026-12-07-decode-attention/run_device.sh
step "the 8B at 4-bit with it, against bf16 (only where x in shared memory wins at M = 16)"
gain=$(python3 - "$out/q4_xsm_$card.json" <<'PY'
import json, sys
try:
    rows = json.load(open(sys.argv[1]))["rows"]
except Exception:
    print(0); sys.exit()
t = {(r["variant"], r["N"], r["K"], r["M"]): r["us"] for r in rows}
r16 = [t[("xsm", N, K, 16)] / t[("base", N, K, 16)] for (v, N, K, M) in t if v == "base" and M == 16 and ("xsm", N, K, 16) in t]
print(int(bool(r16) and min(r16) < 0.95))
PY
)
[ "$gain" = 1 ] && fits 170 && timeout 170 python3 experiments/2026-12-03-q4-gpu/run_8b.py --profile --no-peer --bf16 .gpu/8b-b16-sm_80 \
  --json "$out/q4_8b_xsm_$card.json" 2>&1 | grep -v Warning | tail -14
step "the bf16 GEMM's k splits, the committed object at M = 1 and 16 (raw, .gpu/splits: variants.json of splits per shape)"
[ -d .gpu/splits ] && fits 90 && timeout 90 python3 bench/gemm_bench.py run --ptx .gpu/splits --ms 1,16 \
  --shapes 6144x4096,4096x4096,4096x12288 --json "$out/gemm_splits_$card.json" 2>&1 | grep "^raw"
step "end"
