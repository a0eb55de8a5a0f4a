#!/bin/bash
# On the H200, one call (bash bench/on_device.sh bash experiments/2026-12-06-kv-write/run_device.sh):
# run_exact.sh, then run_8b.sh (what each measures is at its top).
set -uo pipefail
bash experiments/2026-12-06-kv-write/run_exact.sh
bash experiments/2026-12-06-kv-write/run_8b.sh
