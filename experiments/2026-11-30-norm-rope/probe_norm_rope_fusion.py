"""How IREE's own lowering splits Qwen3's q_norm + rope: a one-layer probe, compiled to the flow phase for sm_80.

    python experiments/2026-11-30-norm-rope/probe_norm_rope_fusion.py     # prints the dispatches per flag set

The probe is a q projection (4096 -> 32 heads x 128, bf16) viewed as heads, export/qwen3.py's
`rms_norm` and `apply_rope`, exported with iree-turbine and compiled with the GPU flags of
`make compile` plus each of IREE's dispatch-creation / global-optimization fusion switches. It is
what motivated kernels/norm_rope/: after the matvec the norm + rope takes five dispatches, four with
`--iree-dispatch-creation-enable-early-trunc-fusion`, five with every other switch
(probe_norm_rope_fusion_sm_80.txt beside it; docs/architecture.md, "Head norm + rope").
"""

from __future__ import annotations

import re
import subprocess
import tempfile
from pathlib import Path

FLAG_SETS = [[], ["--iree-dispatch-creation-enable-aggressive-fusion"],
             ["--iree-dispatch-creation-element-wise-fuse-multi-reduction"],
             ["--iree-dispatch-creation-enable-early-trunc-fusion"],
             ["--iree-dispatch-creation-propagate-collapse-across-expands"],
             ["--iree-global-opt-experimental-enable-edge-reshape-propagation"],
             ["--iree-global-opt-propagate-transposes"]]
H, HD, HIDDEN = 32, 128, 1024


def main() -> None:
    import iree.turbine.aot as aot
    import torch

    from dflash_iree.export.compile import compile_flags, iree_compile_tool, resolve_arch
    from dflash_iree.export.qwen3 import apply_rope, rms_norm

    class Probe(torch.nn.Module):
        def forward(self, x, cos, sin, wq, w):
            q = torch.nn.functional.linear(x, wq).view(1, 1, H, HD)
            return apply_rope(rms_norm(q, w, 1e-6), cos, sin)

    bf = torch.bfloat16
    args = (torch.randn(1, 1, HIDDEN, dtype=bf), torch.randn(1, 1, HD, dtype=bf), torch.randn(1, 1, HD, dtype=bf),
            torch.randn(H * HD, HIDDEN, dtype=bf), torch.randn(HD, dtype=bf))
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "probe.mlir"
        aot.export(Probe(), *args).save_mlir(src)
        for extra in FLAG_SETS:
            out = Path(tmp) / "flow.mlir"
            subprocess.run([iree_compile_tool(), str(src), *compile_flags(resolve_arch("sm_80")[0]), *extra,
                            "--compile-to=flow", "-o", str(out)], check=True)
            found = re.findall(r"flow\.executable\.export public @\S+?_dispatch_\d+_(\S+)", out.read_text())
            print(" ".join(extra) or "(make compile's flags)", f"-> {len(found)}:", ", ".join(found))


if __name__ == "__main__":
    main()
