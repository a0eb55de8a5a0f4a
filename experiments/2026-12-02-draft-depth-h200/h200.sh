#!/bin/bash
# On the H200 (carry [".gpu/wheels-depth", ".gpu/artifacts.zip"]; artifacts demo-s4d-sm_80: the demo pair
# --streams 4 for sm_80 from the depth branch with the S > 1 sm_80 fix): the depth rule's cost curve
# (`dflash-iree calibrate`) and `bench --parallel 1,4` with the rule on (dflash) and off (full), plain beside.
set -uo pipefail
python3 -m pip install -q --no-deps --no-index --upgrade --target /tmp/site .gpu/wheels-depth/*.whl
python3 -m zipfile -e .gpu/artifacts.zip .gpu
# the manifest names the checkpoints relative to the worktree it was compiled from (../../../wt-h200/models)
mkdir -p ../wt-h200 && ln -sfn "$PWD/models" ../wt-h200/models
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
cli=/tmp/site/bin/dflash-iree
A=.gpu/demo-s4d-sm_80
$cli calibrate --artifacts $A --device cuda --repeats 20 --context 128 | tee "$OUT/calibrate_h200.txt"
cp $A/depth_cost.json "$OUT/depth_cost_h200.json"
$cli bench --artifacts $A --device cuda --prompts bench/prompts/code.jsonl --limit 16 --max-new-tokens 128 \
  --parallel 1,4 --runs 3 --json "$OUT/bench_parallel_h200.json" | tee "$OUT/bench_parallel_h200.txt"
