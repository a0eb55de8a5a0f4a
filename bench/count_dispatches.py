"""Dispatches per call of each entry point under extra iree-compile flags, read from the flow IR.

    .venv/bin/python bench/count_dispatches.py EXPORT.mlirbc --arch sm_80 [--no-gpu-opt] [-- FLAG ...]

EXPORT is an exported module, e.g. one from the export cache (~/.cache/dflash-iree); its named ops are lowered
for the arch first, as `make compile` does (export/splice.py). It is compiled only to the flow phase (about a minute for the 8B pair on 2 cores), so a
fusion flag can be judged before paying for codegen; the figures quoted in docs/benchmarks.md
("Qwen3-8B shapes": 1308, 944, 656 decode dispatches) came from this count.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
from pathlib import Path

from dflash_iree.export.compile import GPU_OPT, compile_flags, iree_compile_tool, resolve_arch
from dflash_iree.export.splice import splice_file


def count(flow_text: str, functions=("decode", "verify", "draft")) -> dict[str, int]:
    """`flow.dispatch` ops in the body of each `util.func public @NAME$async` of the flow IR."""
    out = {}
    for name in functions:
        i = flow_text.find(f"util.func public @{name}$async(")
        if i < 0:
            continue
        j = flow_text.find("\n  }\n", i)
        out[name] = len(re.findall(r"flow\.dispatch @", flow_text[i:j]))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("mlir")
    ap.add_argument("--arch", default="sm_80")
    ap.add_argument("--no-gpu-opt", action="store_true", help=f"leave out {' '.join(GPU_OPT)} (the arch flags before it)")
    args, flags = ap.parse_known_args()  # the rest: extra iree-compile flags
    flags = [f for f in flags if f != "--"]
    arch = resolve_arch(args.arch)[0]
    base = [f for f in compile_flags(arch) if not (args.no_gpu_opt and f in GPU_OPT)]
    with tempfile.TemporaryDirectory() as work:
        flow = Path(work) / "flow.mlir"
        source, splice_flags, _ = splice_file(args.mlir, Path(work) / "spliced.mlirbc", arch.name)
        subprocess.run([iree_compile_tool(), str(source), *base, *splice_flags, *flags, "--compile-to=flow",
                        "-o", str(flow)], check=True)
        counts = count(flow.read_text())
    print(" ".join(flags) or "(the arch's flags)", counts)
    return 0


if __name__ == "__main__":
    sys.exit(main())
