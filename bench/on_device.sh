#!/bin/bash
# On the GPU machine (the `run` tool, carry [".gpu/wheels", ".gpu/artifacts.zip"] made by
# bench/pack_device.py): refuse wheels built from other Python sources than this tree (exit 2), install
# them into /tmp/site with pip (no index needed), unpack the artifacts into .gpu/, then run the command given with PYTHONPATH=/tmp/site, e.g.
#   bash bench/on_device.sh python3 bench/gpu_check.py run --json "$OUT/gpu_check.json"
# Run the bench scripts by path (python3 bench/X.py); `python3 -m dflash_iree` from the repository
# root would import the checkout's dflash_iree/ folder, not the install: use /tmp/site/bin/dflash-iree.
# DFLASH_SITE picks another install folder.
set -euo pipefail
site=${DFLASH_SITE:-/tmp/site}
if [ ! -f .gpu/wheels/sources.sha256 ] || ! sha256sum --check --quiet .gpu/wheels/sources.sha256 > /dev/null 2>&1 \
   || [ "$(cut -c67- .gpu/wheels/sources.sha256)" != "$(find dflash_iree export kernels runtime -name '*.py' -not -path '*/__pycache__/*' | LC_ALL=C sort)" ]; then
  echo "bench/on_device.sh: .gpu/wheels was built from other Python sources than this tree (or before they were recorded): rerun python bench/pack_device.py wheels" >&2
  exit 2
fi
python3 -m pip install --quiet --no-deps --no-index --upgrade --target "$site" .gpu/wheels/*.whl  # --upgrade: replace an earlier install
if [ -f .gpu/artifacts.zip ]; then python3 -m zipfile -e .gpu/artifacts.zip .gpu; fi
export PYTHONPATH=$site PYTHONUNBUFFERED=1
exec "$@"
