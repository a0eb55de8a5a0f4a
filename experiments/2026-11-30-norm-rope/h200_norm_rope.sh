#!/bin/bash
# Device calls (the `run` tool, nvidia-h200) for the head norm + rope dispatch and the per-step cache
# rows. Results go to $OUT. Carry .gpu/site.zip and .gpu/artifacts.zip, made here by
#   python bench/pack_runtime.py --artifacts 8b-b16-sm_80 8b-b8-sm_80 8b-b16nr-sm_80 8b-b16grp-sm_80 \
#       tiny tiny-sm_80 demo-sm_80 norm_rope expected.json
#   bench/h200_norm_rope.sh check   # kernel bits, tiny/demo exactness, block 16 side by side: before
#                                   # (grp), norm + rope only (nr), both (the build of this commit)
#   bench/h200_norm_rope.sh final   # kernel bits (the f32 bound), both blocks with peers and the kernel profile
mkdir -p /tmp/site && python3 -m zipfile -e .gpu/site.zip /tmp/site && python3 -m zipfile -e .gpu/artifacts.zip .gpu
export PYTHONPATH=/tmp/site:. PYTHONUNBUFFERED=1
if [ "$1" = check ]; then
  python3 bench/norm_rope_check.py run --json "$OUT/norm_rope_h200.json"
  python3 bench/gpu_check.py run --device cuda --arch sm_80 --json "$OUT/gpu_check_h200_norm_rope.json"
  for v in grp nr ""; do
    python3 bench/speed_8b.py run --no-peers --blocks 16 --variant "$v" --json "$OUT/speed_8b_h200_norm_rope_ab${v:+_$v}.json"
  done
else
  python3 bench/norm_rope_check.py run --json "$OUT/norm_rope_h200.json"
  python3 bench/speed_8b.py run --profile --json "$OUT/speed_8b_h200_norm_rope.json"
fi
