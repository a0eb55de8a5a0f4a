"""Dispatches (and tensor slices / updates, where IREE would copy) per call of the one-stream entry
points against the S-stream ones and the one-stream module's, from the flow IR of a small export.

    .venv/bin/python experiments/2026-12-02-one-stream/dispatch_counts.py TINY_DIR ARCH STREAMS [OUT.json [DTYPE]]

TINY_DIR: a tiny pair (tests/tiny.py). Exports only the entry points counted (max_context 256,
the arch's attention form; DTYPE bf16 gives the GPU kernels their dtype, the tiny pair's own is f32), lowers the named ops for ARCH (export/splice.py, as a compile does),
and compiles to the flow phase (bench/count_dispatches.py's method; no codegen, so sm_80 counts on
the 2-core host in minutes).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from dflash_iree.export import aot
from dflash_iree.export import compile as C
from dflash_iree.export.compile import compile_flags, iree_compile_tool, resolve_arch
from dflash_iree.export.splice import splice_file

S1 = ["decode", "verify_draft", "decode_sampled", "verify_draft_sampled"]
ONE = ["decode_stream", "verify_draft_stream", "decode_stream_sampled", "verify_draft_stream_sampled",
       "prefill_stream", "absorb_stream"]


def per_function(flow: str, names: list[str]) -> dict:
    out = {}
    for name in names:
        i = flow.find(f"util.func public @{name}$async(")
        if i < 0:
            continue
        j = flow.find("\n  }\n", i)
        body = flow[i:j]
        out[name] = {"dispatches": len(re.findall(r"flow\.dispatch @", body)),
                     "tensor_slices": len(re.findall(r"flow\.tensor\.slice", body)),
                     "tensor_updates": len(re.findall(r"flow\.tensor\.update", body)),
                     "tensor_loads": len(re.findall(r"flow\.tensor\.load", body))}
    return out


def main() -> None:
    tiny, arch_name, streams = sys.argv[1], sys.argv[2], int(sys.argv[3])
    arch = resolve_arch(arch_name)[0]
    names = S1 + (ONE if streams > 1 else [])
    p = C.plan(f"{tiny}/target", f"{tiny}/drafter", max_context=256, streams=streams, attention=arch.attention,
               dtype=sys.argv[5] if len(sys.argv) > 5 else None)
    with tempfile.TemporaryDirectory() as work, torch.no_grad():
        mlir = Path(work) / "export.mlirbc"
        o, _ = aot.export_module(C._build_pair(p), aot.export_shapes(p), p.sampled, only=names)
        o.save_mlir(str(mlir))
        source, flags, report = splice_file(mlir, Path(work) / "spliced.mlirbc", arch.name)
        flow = Path(work) / "flow.mlir"
        subprocess.run([iree_compile_tool(), str(source), *compile_flags(arch), *flags, "--compile-to=flow",
                        "-o", str(flow)], check=True)
        counts = per_function(flow.read_text(), names)
    result = {"arch": arch.name, "streams": streams, "attention": arch.attention, "dtype": p.dtype,
              "splices": {k: v.get("entries", v) if isinstance(v, dict) else v for k, v in report.items()},
              "per_call": counts}
    print(json.dumps(result["per_call"], indent=1))
    if len(sys.argv) > 4:
        Path(sys.argv[4]).write_text(json.dumps(result, indent=1, default=str) + "\n")


if __name__ == "__main__":
    main()
