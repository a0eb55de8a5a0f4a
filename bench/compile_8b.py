"""Measure the Qwen3-8B + DFlash-b16 compile here: export once, then lower for each arch.

    .venv/bin/python bench/compile_8b.py [--archs gfx1151 gfx1100 sm_89] [--json OUT.json]

Reads only tests/fixtures/qwen3-8b/config.json and tests/fixtures/qwen3-8b-dflash-b16/config.json
(no weights: the modules are built on the meta device). Block 16, max_context 4096, bf16. The export
runs without the export cache, so its time is a cold export. Prints the table of docs/benchmarks.md
and writes the figures as JSON. A fresh `make compile ARCH=...` costs export + that arch's compile;
a second arch for the same pair reuses the cached export.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import sys
import tempfile
import time
from pathlib import Path

from dflash_iree.export import compile as cc

ROOT = Path(__file__).resolve().parents[1]
TARGET = ROOT / "tests" / "fixtures" / "qwen3-8b"
DRAFTER = ROOT / "tests" / "fixtures" / "qwen3-8b-dflash-b16"


def _cpu() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--archs", nargs="+", default=["gfx1151", "gfx1100", "sm_89"])
    ap.add_argument("--json", default=str(ROOT / ".gpu" / "compile_8b.json"))
    args = ap.parse_args()

    log = cc.Progress()
    p = cc.plan(TARGET, DRAFTER, block_size=16, max_context=4096, dtype="bf16")
    result = {"machine": {"cpus": os.cpu_count(), "cpu": _cpu(), "load_at_start": os.getloadavg()},
              "pair": {"target": str(TARGET.relative_to(ROOT)), "drafter": str(DRAFTER.relative_to(ROOT)),
                       "block_size": p.block_size, "max_context": p.max_context, "dtype": p.dtype},
              "archs": {}}
    with tempfile.TemporaryDirectory(prefix="compile-8b-") as work:
        work = Path(work)
        t0 = time.perf_counter()
        mlir = cc.export_mlir(p, work / "dflash.mlirbc", log)
        result["export"] = {"seconds": round(time.perf_counter() - t0, 1),
                            "mlir_mib": round(mlir.stat().st_size / 2**20, 2),
                            "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024),
                            "entry_points": len(p.entries)}
        for arch in args.archs:
            t0 = time.perf_counter()
            m = cc.lower(p, arch, mlir, work / arch, log)
            result["archs"][arch] = {
                "compile_seconds": round(time.perf_counter() - t0, 1),
                "vmfb_mib": round(m.stats["module_bytes"] / 2**20, 2),
                "executables": m.stats["executables"],
                "dispatches": m.stats["dispatches"],
                "dispatches_per_call": m.stats["dispatches_per_call"],
                "flags": m.flags,
            }
    result["machine"]["load_at_end"] = os.getloadavg()
    result["versions"] = m.versions

    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    e = result["export"]
    print(f"\nQwen3-8B + DFlash-b16 (block 16, max_context 4096, bf16) on {result['machine']['cpus']} cores "
          f"({result['machine']['cpu']}); export {e['seconds']:.0f} s, once for all archs\n")
    print("| arch | compile | export + compile | .vmfb | executables | dispatches | per call: decode / verify / draft |")
    print("|---|---|---|---|---|---|---|")
    for arch, r in result["archs"].items():
        total = e["seconds"] + r["compile_seconds"]
        call = r["dispatches_per_call"]
        print(f"| {arch} | {r['compile_seconds']:.0f} s | {total:.0f} s ({total / 60:.1f} min) | {r['vmfb_mib']:.2f} MiB "
              f"| {r['executables']} | {r['dispatches']} | {call['decode']} / {call['verify']} / {call['draft']} |")
    print(f"\nwritten to {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
