#!/bin/bash
# Device calls (the `run` tool, nvidia-h200) for q and k's norm + rope as one dispatch and decode's
# q, k and v as one grouped GEMM dispatch. Results go to $OUT. Carry .gpu/site.zip and
# .gpu/artifacts.zip, made here by
#   python bench/pack_runtime.py --artifacts 8b-b16-sm_80 8b-b16pre-sm_80 8b-b16nrp-sm_80 \
#       tiny tiny-sm_80 demo-sm_80 norm_rope expected.json
# where 8b-b16pre is the build before (`make compile` of the commit before) and 8b-b16nrp this one
# `--without decode-qkv` (the norm + rope pairs alone).
#   bench/h200_pairs.sh check   # kernel bits, tiny/demo exactness, block 16: pre, nrp, this build
#   bench/h200_pairs.sh again   # block 16 again in the other order, this build with --profile
#   bench/h200_pairs.sh peers   # this build with the PyTorch peers
mkdir -p /tmp/site && python3 -m zipfile -e .gpu/site.zip /tmp/site && python3 -m zipfile -e .gpu/artifacts.zip .gpu
export PYTHONPATH=/tmp/site:. PYTHONUNBUFFERED=1
speed() { timeout "$1" python3 bench/speed_8b.py run --no-peers --blocks 16 --variant "$2" "${@:4}" \
    --json "$OUT/speed_8b_h200_pairs${2:+_$2}$3.json"; }
if [ "$1" = check ]; then
  timeout 60 python3 bench/norm_rope_check.py run --json "$OUT/norm_rope_h200_pairs.json"
  timeout 150 python3 bench/gpu_check.py run --device cuda --arch sm_80 --json "$OUT/gpu_check_h200_pairs.json" || exit 1
  speed 100 pre _1; speed 100 nrp _1; speed 100 "" _1
elif [ "$1" = again ]; then
  speed 100 "" _2; speed 100 nrp _2; speed 100 pre _2; speed 200 "" "" --profile
else
  timeout 540 python3 bench/speed_8b.py run --blocks 16 --json "$OUT/speed_8b_h200_pairs_peers.json"
fi
