#!/bin/bash
# On the H200 (carry as run_device.sh): the kernel times of decode, verify and draft at the 8B shape (block 8),
# the row-invariant build and the default one, each in its own process (bench/speed_8b.py --profile).
set -uo pipefail
out=${OUT:-/tmp/out}
for v in -ri -s1; do
  python3 bench/speed_8b.py run --arch sm_80 --blocks 8 --variant=$v --no-peers --profile \
      --json "$out/profile_8b$v.json" 2>&1 | tail -30 || echo "profile $v exit $?"
done
