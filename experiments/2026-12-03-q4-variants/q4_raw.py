"""Where the 4-bit skinny GEMM's time goes on the H200 (issue #28): build variants of
kernels/gemm/gemm_gpu.cu's 4-bit object (GM_BITS 4) and launch them directly through CuPy at M = 1.

    .venv/bin/python experiments/2026-12-03-q4-variants/q4_raw.py build --out .gpu/q4-variants   # here
    python3 experiments/2026-12-03-q4-variants/q4_raw.py run --dir .gpu/q4-variants --json out.json   # there

Variants (a patched copy of the kernel's sources; the committed kernel is `base`):
- base: as committed (16 chunks a round, 4 workgroups an SM);
- u8 / u32: 8 or 32 chunks a round;
- minb2: 2 workgroups an SM (launch bounds: up to 255 registers);
- noscale: the scale and offset not loaded (s = 1/64, o = 0): what their loads cost;
- nodq: no dequantization (the packed word taken as four bf16 pairs): the memory path and the
  matrix instructions alone.
Time per matmul from a CUDA graph over R distinct weights (>= 384 MB of packed words together), as
bench/gemm_bench.py times its raw arm; the plan (splits, workgroups) is kernels/gemm `gemm_plan`'s.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SHAPES = [(4096, 4096), (12288, 4096), (4096, 12288)]
GROUP = 64
PATCHES = {
    "base": ([], []),
    "u8": (["-DGM_U=8"], []),
    "u32": (["-DGM_U=32"], []),
    "minb2": (["-DGM_MINB=2"], []),
    "noscale": ([], [("    r->s = gm_f32(ws.s[gi]);", "    r->s = 0.015625f;"),
                     ("      r->o = gm_f32(((const unsigned short*)ws.o)[gi]);", "      r->o = 0.0f;")]),
    "nodq": ([], [("{ gm_dequant(f, r.words, r.s, r.o); }", "{ unsigned p[GM_WLANE_V / 2]; for (int i = 0; i < GM_WLANE_V / 2; ++i) p[i] = r.words[0] ^ (unsigned)i; gm_wfrag_set(f, p); }")]),
}


def build(out: Path) -> None:
    sys.path.insert(0, str(ROOT))
    from dflash_iree.kernels.build import CLANG, targets

    arch, _, args = targets()["gemm_q4_sm_80.ptx"]
    out = out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    meta = []
    for name, (defs, subs) in PATCHES.items():
        with tempfile.TemporaryDirectory() as tmp:
            shutil.copytree(ROOT / "kernels/gemm", Path(tmp) / "gemm")
            shutil.copy(ROOT / "kernels/gpu.h", Path(tmp) / "gpu.h")
            body = Path(tmp) / "gemm/gemm_body.h"
            text = body.read_text()
            for a, b in subs:
                if a not in text:
                    raise SystemExit(f"{name}: patch target not found: {a!r}")
                text = text.replace(a, b)
            body.write_text(text)
            subprocess.run([CLANG, *args, *defs, "-o", str(out / f"{name}.ptx")], cwd=Path(tmp) / "gemm", check=True)
        meta.append({"name": name, "file": f"{name}.ptx", "defines": defs, "patches": subs})
        print(name, flush=True)
    from dflash_iree.kernels.gemm import gemm_plan

    plans = {f"{N}x{K}": {"splits": (p := gemm_plan(N, K, "sm_80")).splits, "grid_x": p.grid_x,
                          "col_blocks": p.col_blocks} for N, K in SHAPES}
    (out / "variants.json").write_text(json.dumps({"variants": meta, "plans": plans}, indent=1))


def run(d: Path, out_json: Path) -> None:
    import cupy
    import numpy as np
    import torch

    sys.path.insert(0, str(ROOT / "bench"))
    from common import copy_bandwidth
    from gemm_bench import _time_graph

    meta = json.loads((d / "variants.json").read_text())
    bw = copy_bandwidth()
    rec = {"copy": bw, "rows": []}
    gen = torch.Generator(device="cuda").manual_seed(0)
    for N, K in SHAPES:
        plan = meta["plans"][f"{N}x{K}"]
        S, gx, cb = plan["splits"], plan["grid_x"], plan["col_blocks"]
        R = max(2, math.ceil((384 << 20) / (N * K // 2)))
        qs = [torch.randint(-2**31, 2**31 - 1, (N, K // 8), generator=gen, device="cuda", dtype=torch.int32) for _ in range(R)]
        ss = [(torch.rand(N, K // GROUP, generator=gen, device="cuda") / 64).to(torch.bfloat16) for _ in range(R)]
        bs = [(-torch.rand(N, K // GROUP, generator=gen, device="cuda") / 8).to(torch.bfloat16) for _ in range(R)]
        x = torch.randn(1, K, generator=gen, device="cuda").to(torch.bfloat16)
        wbytes = N * K // 2 + 2 * 2 * N * K // GROUP
        for v in meta["variants"]:
            mod = cupy.RawModule(path=str(d / v["file"]))
            f = mod.get_function("dflash_q4gemm_mt1")
            y = torch.empty(1, N, dtype=torch.bfloat16, device="cuda")
            part = torch.empty(max(1, S * N), dtype=torch.float32, device="cuda")
            cnt = torch.zeros(cb, dtype=torch.int32, device="cuda")
            i32, u64 = np.int32, np.uint64

            def go(i):
                st = cupy.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream)
                f((gx, S, 1), (128, 1, 1), (u64(x.data_ptr()), u64(qs[i].data_ptr()), u64(ss[i].data_ptr()),
                                            u64(bs[i].data_ptr()), u64(cnt.data_ptr()), u64(y.data_ptr()),
                                            u64(part.data_ptr()), i32(1), i32(K), i32(K // S), i32(S), i32(gx), i32(N),
                                            i32(0), i32(GROUP)), stream=st)
            t = _time_graph(lambda: [go(i) for i in range(R)], R)
            row = {"variant": v["name"], "N": N, "K": K, "splits": S, "us": t * 1e6,
                   "frac": wbytes / t / 1e12 / bw["tb_per_s"], "regs": f.num_regs, "local_bytes": f.local_size_bytes}
            rec["rows"].append(row)
            print(f"{v['name']:8s} {N}x{K} S={S}: {t * 1e6:8.2f} us, {row['frac']:.3f} of copy, regs {f.num_regs}, "
                  f"local {f.local_size_bytes}", flush=True)
        del qs, ss, bs
        torch.cuda.empty_cache()
    out_json.write_text(json.dumps(rec, indent=1) + "\n")


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("cmd", choices=("build", "run"))
    ap.add_argument("--out", "--dir", dest="dir", type=Path, required=True)
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    build(a.dir) if a.cmd == "build" else run(a.dir, a.json)
