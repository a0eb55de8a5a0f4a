"""Why bench/norm_rope_check.py's f32 variant case failed on the H100: a CPU stand-in for the
kernel's scale (the mean of squares summed in another order, then 1/sqrt in float32, where eager
uses torch's rsqrt) against eager `zc_rms_norm` + `partial_rope`, on the check's own inputs.
Prints, per variant case, the elements outside the old bound (1 ulp on the dims a partial rotary
passes through) and outside the new one (4 eps |y| there), and the largest pass-through error.

    .venv/bin/python experiments/2026-12-05-hybrid-kernels-gpu/f32_bound.py
"""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import norm_rope_check as nc  # noqa: E402
from dflash_iree.export.qwen35 import partial_rope  # noqa: E402

for case in (c for c in nc.CASES if nc._variant(c) is not None):
    old = new = 0
    worst = 0.0
    for seed in range(4):
        xs, cos, sin = nc._inputs(case, seed)
        for x, w in xs:
            y, want = nc._eager(case, x, w, cos, sin)
            D, R = w.shape[-1], cos.shape[-1]
            ms = (x[..., :D].double() ** 2).mean(-1, keepdim=True).float()
            got = partial_rope(((x[..., :D].float() * (1.0 / torch.sqrt(ms + case[5]))) * (1.0 + w.float())).to(y.dtype),
                               cos, sin)
            ulp = (nc._ordered(got) - nc._ordered(want)).abs()[..., R:]
            err = (got.float() - want.float()).abs()[..., R:]
            eps = torch.finfo(y.dtype).eps
            old += int((ulp > 1).sum())
            new += int(((ulp > 1) & (err > 4 * eps * y[..., R:].float().abs())).sum())
            worst = max(worst, float((err / (eps * y[..., R:].float().abs()).clamp_min(1e-30)).max()))
    print(f"{nc._name(case)}: pass-through dims outside 1 ulp {old}, outside 4 eps |y| {new}; largest {worst:.2f} eps |y|")
