#!/bin/bash
# On the GPU machine (the `run` tool, carry [".gpu/wheels", ".gpu/artifacts.zip"] made by
# bench/pack_device.py): install the wheels into /tmp/site with pip (no index needed), unpack the
# artifacts into .gpu/, then run the command given with PYTHONPATH=/tmp/site, e.g.
#   bash bench/on_device.sh python3 bench/gpu_check.py run --json "$OUT/gpu_check.json"
# Run the bench scripts by path (python3 bench/X.py); `python3 -m dflash_iree` from the repository
# root would import the checkout's dflash_iree/ folder, not the install: use /tmp/site/bin/dflash-iree.
# DFLASH_SITE picks another install folder.
set -euo pipefail
site=${DFLASH_SITE:-/tmp/site}
python3 -m pip install --quiet --no-deps --no-index --upgrade --target "$site" .gpu/wheels/*.whl  # --upgrade: replace an earlier install
if [ -f .gpu/artifacts.zip ]; then python3 -m zipfile -e .gpu/artifacts.zip .gpu; fi
export PYTHONPATH=$site PYTHONUNBUFFERED=1
exec "$@"
