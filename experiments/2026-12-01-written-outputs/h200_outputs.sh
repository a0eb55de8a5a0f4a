#!/bin/bash
# Device call (the `run` tool, nvidia-h200) for outputs written into the caller's pinned buffers
# (export/aot.py `writes`): the tiny and demo pairs' exactness, then the 8B block-16 build before
# (variant "pre", run by the code before, unpacked in .gpu/old) and this one, alternating, each its
# own process; the second of this build with --profile. Carry .gpu/site.zip and .gpu/artifacts.zip,
# made here by
#   python bench/pack_runtime.py --artifacts 8b-b16-sm_80 8b-b16pre-sm_80 old tiny tiny-sm_80 demo-sm_80 expected.json
# where .gpu/old holds `git archive` of the commit before (runtime, dflash_iree, export, bench).
mkdir -p /tmp/site && python3 -m zipfile -e .gpu/site.zip /tmp/site && python3 -m zipfile -e .gpu/artifacts.zip .gpu
ln -sfn .. .gpu/old/.gpu  # the old code's .gpu/ is this one
export PYTHONUNBUFFERED=1
new() { PYTHONPATH=/tmp/site:. timeout "$1" python3 bench/speed_8b.py run --blocks 16 --no-peers "${@:2}"; }
old() { (cd .gpu/old && PYTHONPATH=/tmp/site:. timeout 100 python3 bench/speed_8b.py run --blocks 16 --no-peers \
    --variant pre --json "$1"); }
PYTHONPATH=/tmp/site:. timeout 150 python3 bench/gpu_check.py run --device cuda --arch sm_80 \
    --json "$OUT/gpu_check_h200_outputs.json" || exit 1
old "$OUT/speed_8b_h200_outputs_pre_1.json"
new 100 --json "$OUT/speed_8b_h200_outputs_1.json"
old "$OUT/speed_8b_h200_outputs_pre_2.json"
new 240 --profile --json "$OUT/speed_8b_h200_outputs.json"
