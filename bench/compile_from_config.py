"""Compile a pair from its config.json files alone (no weights): export once, then lower for each arch.

    .venv/bin/python bench/compile_from_config.py [--archs gfx1151 gfx1100 sm_89] [--json OUT.json]
    .venv/bin/python bench/compile_from_config.py --target tests/fixtures/qwen3.5-27b \
        --drafter tests/fixtures/qwen3.6-27b-dflash2 --archs sm_80 gfx1151 host --keep .gpu/27b

The default pair is tests/fixtures/qwen3-8b with tests/fixtures/qwen3-8b-dflash-b16 at block 16.
The modules are built on the meta device; max_context 4096, bf16. The export runs without the
export cache, so its time is a cold export. Prints the table of docs/benchmarks.md (compile time,
.vmfb size, dispatches per entry point) and writes the figures as JSON. A fresh `make compile
ARCH=...` costs export + that arch's compile; a second arch for the same pair reuses the cached
export. `--keep DIR` keeps each arch's artifact folder as DIR-ARCH (weight-free: bind random weights
to time them, as bench/speed_8b.py does).
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


def _shown(path: Path) -> str:
    try:
        return str(path.resolve().relative_to(ROOT))
    except ValueError:
        return str(path)


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
    ap.add_argument("--target", type=Path, default=TARGET, help="the target's config folder")
    ap.add_argument("--drafter", type=Path, default=DRAFTER, help="the drafter's config folder")
    ap.add_argument("--block-size", type=int, default=None, help="default: the drafter's own")
    ap.add_argument("--json", default=str(ROOT / ".gpu" / "compile_from_config.json"))
    ap.add_argument("--keep", type=Path, default=None, help="keep each arch's artifacts as KEEP-ARCH")
    args = ap.parse_args()

    log = cc.Progress()
    forms = {cc.resolve_arch(a)[0].attention for a in args.archs}
    if len(forms) > 1:  # one export serves every arch of a run
        sys.exit(f"--archs {' '.join(args.archs)}: these archs export different attention forms {sorted(forms)}; "
                 "compile them in separate runs")
    p = cc.plan(args.target, args.drafter, block_size=args.block_size, max_context=4096, dtype="bf16",
                attention=forms.pop())
    result = {"machine": {"cpus": os.cpu_count(), "cpu": _cpu(), "load_at_start": os.getloadavg()},
              "pair": {"target": _shown(args.target), "drafter": _shown(args.drafter),
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
            out = Path(f"{args.keep}-{arch}") if args.keep else work / arch
            m = cc.lower(p, arch, mlir, out, log)
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
    pair = result["pair"]
    print(f"\n{pair['target']} + {pair['drafter']} (block {p.block_size}, max_context 4096, bf16) on {result['machine']['cpus']} cores "
          f"({result['machine']['cpu']}); export {e['seconds']:.0f} s, once for all archs\n")
    names = list(next(iter(result["archs"].values()))["dispatches_per_call"])
    print(f"| arch | compile | export + compile | .vmfb | executables | dispatches | per call: {' / '.join(names)} |")
    print("|---|---|---|---|---|---|---|")
    for arch, r in result["archs"].items():
        total = e["seconds"] + r["compile_seconds"]
        call = r["dispatches_per_call"]
        print(f"| {arch} | {r['compile_seconds']:.0f} s | {total:.0f} s ({total / 60:.1f} min) | {r['vmfb_mib']:.2f} MiB "
              f"| {r['executables']} | {r['dispatches']} | {' / '.join(str(call[n]) for n in names)} |")
    print(f"\nwritten to {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
