#!/bin/bash
# On the H200 (the lead runs it through the `run` tool; see README.md here for the host steps and the carry):
#   bash bench/on_device.sh bash experiments/2026-12-02-streams/run_device.sh
# The demo pair at 1 and 4 streams on the 4-stream module, plain and drafted alternated, then the
# 1-stream module at 1 stream (1-stream DFlash on the 4-stream module against the 1-stream module).
set -euo pipefail
cli=/tmp/site/bin/dflash-iree
out=${OUT:-/tmp/out}
prompts=bench/prompts/code.jsonl
$cli bench --artifacts .gpu/demo-s4-sm_80 --target models/demo/target --drafter models/demo/drafter --device cuda --prompts $prompts --limit 16 --max-new-tokens 128 \
    --parallel 1,4 --runs 3 --json "$out/parallel_s4.json" --quiet || echo "s4 bench exit $?"  # 1: drafted and plain parted
$cli bench --artifacts .gpu/demo-sm_80 --target models/demo/target --drafter models/demo/drafter --device cuda --prompts $prompts --limit 16 --max-new-tokens 128 \
    --parallel 1 --runs 3 --json "$out/parallel_s1.json" --quiet || echo "s1 bench exit $?"
