#!/bin/bash
# On the H200, one call (carry [".gpu/wheels", ".gpu/artifacts.zip"]; README.md here has the host steps):
#   bash bench/on_device.sh bash experiments/2026-12-03-streams-row-invariant/run_device.sh
# Issue #29's H200 goals on today's build (row-invariant kernels, decode_steps in the one-stream module),
# the 8B shape first:
# 0. the Qwen3-8B shape's step costs at one and four streams (experiments/2026-12-02-streams-8b/), the
#    one-stream module with decode_steps (plain decoding as the engine runs it) and a 4-stream module of today;
# 1. 1-stream DFlash on the demo pair's 4-stream module (its one-stream form) against the 1-stream module,
#    9 rounds alternated in one process (medians within 3%); solo == together on the same 4-stream module;
# 2. `bench --parallel 1,4` on the 4-stream demo module, plain and drafted alternated;
# 3. for issue #24: skinny-GEMM build variants at M = 1 and 16 (experiments/2026-12-03-gemm-m1-variants/), if CuPy is here.
set -uo pipefail
cli=/tmp/site/bin/dflash-iree
out=${OUT:-/tmp/out}
demo="--target models/demo/target --drafter models/demo/drafter"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv > "$out/gpu.csv" 2>&1
python3 experiments/2026-12-02-streams-8b/h200_8b_streams.py --s1 8b-b8-k4-sm_80 --s4 8b-b8-s4-sm_80 \
    --json "$out/streams_8b_h200.json" 2>&1 | tail -40 || echo "8b exit $?"
python3 experiments/2026-12-02-one-stream/alternated.py --device cuda --s4 .gpu/demo-s4-rows-sm_80 --s1 .gpu/demo-k4-sm_80 \
    --limit 16 --max-new-tokens 128 --rounds 9 --json "$out/one_stream_h200.json" 2>&1 | tail -4 || echo "alternated exit $?"
python3 experiments/2026-12-03-gpu-row-invariance/solo_together.py --artifacts .gpu/demo-s4-rows-sm_80 --device cuda \
    --json "$out/solo_together_h200.json" 2>&1 | tail -3 || echo "solo exit $?"
$cli bench --artifacts .gpu/demo-s4-rows-sm_80 $demo --device cuda --prompts bench/prompts/code.jsonl --limit 16 \
    --max-new-tokens 128 --parallel 1,4 --runs 3 --json "$out/parallel_s4.json" --quiet || echo "s4 bench exit $?"
if python3 -c "import cupy" 2>/dev/null; then
    python3 bench/gemm_bench.py run --ptx .gpu/gemm-variants --ms 1,16 \
        --shapes 6144x4096,4096x4096,24576x4096,4096x12288,151936x4096 --json "$out/gemm_variants_h200.json" 2>&1 \
        | grep -v "^ " | tail -60 || echo "gemm exit $?"
else
    echo "no CuPy here: the GEMM variants were not run"
fi
