#!/bin/bash
# On the H200, one call (the lead runs it through the `run` tool, carry [".gpu/wheels", ".gpu/artifacts.zip"];
# README.md here has the host steps):
#   bash bench/on_device.sh bash experiments/2026-12-03-one-stream-slot/run_device.sh
# 1. 1-stream DFlash on the demo pair's 4-stream module (its one-stream form, the slot as a shape) against
#    the 1-stream module, alternated in one process (issue #29: medians within 3%);
# 2. `bench --parallel 1,4` on the 4-stream module, plain and drafted alternated;
# 3. the Qwen3-8B shape's step costs at one and four streams (experiments/2026-12-02-streams-8b/).
set -uo pipefail
cli=/tmp/site/bin/dflash-iree
out=${OUT:-/tmp/out}
demo="--target models/demo/target --drafter models/demo/drafter"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv > "$out/gpu.csv" 2>&1
python3 experiments/2026-12-02-one-stream/alternated.py --device cuda --s4 .gpu/demo-s4-sm_80 --s1 .gpu/demo-sm_80 \
    --limit 16 --max-new-tokens 128 --rounds 5 --json "$out/one_stream_h200.json" 2>&1 | tail -3 || echo "alternated exit $?"
$cli bench --artifacts .gpu/demo-s4-sm_80 $demo --device cuda --prompts bench/prompts/code.jsonl --limit 16 \
    --max-new-tokens 128 --parallel 1,4 --runs 3 --json "$out/parallel_s4.json" --quiet || echo "s4 bench exit $?"
python3 experiments/2026-12-02-streams-8b/h200_8b_streams.py --json "$out/streams_8b_h200.json" 2>&1 | tail -40 \
    || echo "8b exit $?"
