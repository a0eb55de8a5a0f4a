#!/usr/bin/env bash
# The draft depth rule's cost curve on the host CPU: the demo pair (block 8) compiled with --streams 4
# (verify_rows 2, 4, 8), `dflash-iree calibrate` at two contexts, then `bench --parallel 1,4` with the
# rule on (dflash), off (full) and plain, alternated. Writes its results beside this script.
set -euo pipefail
cd "$(dirname "$0")/../.."
HERE=experiments/2026-12-02-draft-depth
OUT=${OUT:-compiled/host-s4}
PY="nice -n 10 .venv/bin/python -m dflash_iree"
[ -f "$OUT/manifest.json" ] || $PY compile --arch host --target models/demo/target --drafter models/demo/drafter \
  --streams 4 --draft-top-k 0 --out "$OUT"
for ctx in 384 128; do  # 128 last: the cost file the bench runs with
  $PY calibrate --artifacts "$OUT" --repeats 20 --context $ctx | tee "$HERE/calibrate-ctx$ctx.txt"
  cp "$OUT/depth_cost.json" "$HERE/depth_cost-ctx$ctx.json"
done
$PY bench --artifacts "$OUT" --prompts bench/prompts/code.jsonl --limit ${LIMIT:-8} --max-new-tokens 64 \
  --parallel 1,4 --runs 3 --json "$HERE/bench_parallel.json" | tee "$HERE/bench_parallel.txt"
