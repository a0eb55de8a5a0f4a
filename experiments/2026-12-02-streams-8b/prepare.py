"""Compile the Qwen3-8B-shaped pair (tests/fixtures/qwen3-8b + qwen3-8b-dflash-b16, random weights on the
device) for sm_80 at block 8 with one and with four streams, into .gpu/8b-b8-s1-sm_80 and .gpu/8b-b8-s4-sm_80.

    .venv/bin/python experiments/2026-12-02-streams-8b/prepare.py [--streams 1 4]
"""

import argparse
import sys
import time
from pathlib import Path

from dflash_iree.export.compile import compile_artifacts

ROOT = Path(__file__).resolve().parents[2]
TARGET = ROOT / "tests" / "fixtures" / "qwen3-8b"
DRAFTER = ROOT / "tests" / "fixtures" / "qwen3-8b-dflash-b16"

ap = argparse.ArgumentParser()
ap.add_argument("--streams", type=int, nargs="+", default=[1, 4])
ap.add_argument("--max-context", type=int, default=2048)
args = ap.parse_args()
for s in args.streams:
    t0 = time.perf_counter()
    compile_artifacts("sm_80", TARGET, DRAFTER, ROOT / ".gpu" / f"8b-b8-s{s}-sm_80", block_size=8,
                      max_context=args.max_context, dtype="bf16", streams=s)
    print(f"streams {s}: {time.perf_counter() - t0:.0f} s", file=sys.stderr)
