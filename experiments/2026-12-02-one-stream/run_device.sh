#!/bin/bash
# On the H200 (the lead runs it through the `run` tool, carry [".gpu/wheels", ".gpu/artifacts.zip"]; README.md
# here has the host steps):
#   bash bench/on_device.sh bash experiments/2026-12-02-one-stream/run_device.sh
# 1-stream DFlash on the 4-stream module (its one-stream form, and its S-stream calls as before) against the
# 1-stream module, alternated in one process (issue #29: medians within 3%).
set -euo pipefail
out=${OUT:-/tmp/out}
python3 experiments/2026-12-02-one-stream/alternated.py --device cuda --s4 .gpu/demo-s4-sm_80 --s1 .gpu/demo-sm_80 \
    --limit 16 --max-new-tokens 128 --rounds 3 --json "$out/one_stream_h200.json"
