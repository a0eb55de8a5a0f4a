"""Decode's RMSNorm as the next GEMM's prologue (issue #24): what the prologue costs the GEMM, timed
without IREE on an H100/H200 through CuPy, and its bits against the norm's own dispatch.

    .venv/bin/python experiments/2026-12-07-norm-prologue/probe.py build --out .gpu/nprobe   # here
    python3 experiments/2026-12-07-norm-prologue/probe.py run --dir .gpu/nprobe --json out.json   # there

The 8B decode step runs, per layer, norm -> q+k+v GEMM and norm -> gate+up (swiglu) GEMM at M = 1.
Three CUDA graphs of 36 such layers (8 distinct weight sets in turn, 2 GB, past L2):
- gemm: the two GEMMs alone (dflash_gemm3_mt1, dflash_swiglu_mt1), no norm;
- norm+gemm: the norm's dispatch (dflash_rms_norm) before each;
- prologue: dflash_gemm3_norm_mt1, dflash_swiglu_norm_mt1 (the norm in the GEMM's prologue).
prologue - gemm is what the prologue costs; norm+gemm - prologue what it saves in a graph (IREE's
launches cost more than a graph's: experiments/2026-12-07-norm-in-gemm/). Bits: the prologue's q, k,
v and swiglu outputs against norm+gemm's, and the norm's row 5 of 16 against its one-row call.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
H, I, KV, LAYERS, SETS = 4096, 12288, 1024, 36, 8
EPS = 1e-6


def build(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    subprocess.run(["clang-19", "-x", "cuda", "--cuda-device-only", "-nocudainc", "-nocudalib", "--cuda-path=/nonexistent",
                    "--cuda-gpu-arch=sm_80", "-Xclang", "-target-feature", "-Xclang", "+ptx78", "-O3", "-S",
                    "gemm_gpu.cu", "-o", str((out / "gemm_sm_80.ptx").resolve())], cwd=ROOT / "kernels/gemm", check=True)
    print("built", out / "gemm_sm_80.ptx")


def run(d: Path, json_out: Path | None) -> None:
    import cupy
    import numpy as np
    import torch

    mod = cupy.RawModule(path=str(d / "gemm_sm_80.ptx"))
    f = {n: mod.get_function(n) for n in ("dflash_gemm3_mt1", "dflash_swiglu_mt1", "dflash_rms_norm",
                                          "dflash_gemm3_norm_mt1", "dflash_swiglu_norm_mt1")}
    regs = {n: fn.num_regs for n, fn in f.items()}
    dev = "cuda"
    torch.manual_seed(0)
    bf = torch.bfloat16
    # the kernels' plans (kernels/gemm/dispatch.py gemm_plan at sm_80): q+k+v 2 splits x 192 blocks,
    # gate+up paired 1 split, 384 workgroups (two blocks of 16 + 16 columns each)
    S3, GX3, S2, GX2 = 2, 192, 1, 384
    ws = [dict(q=torch.randn(H, H, dtype=bf, device=dev) * 0.02, k=torch.randn(KV, H, dtype=bf, device=dev) * 0.02,
               v=torch.randn(KV, H, dtype=bf, device=dev) * 0.02, g=torch.randn(I, H, dtype=bf, device=dev) * 0.02,
               u=torch.randn(I, H, dtype=bf, device=dev) * 0.02,
               n1=(1 + 0.1 * torch.randn(H, device=dev)).to(bf), n2=(1 + 0.1 * torch.randn(H, device=dev)).to(bf))
          for _ in range(SETS)]
    x = (torch.randn(1, H, device=dev) * 3).to(bf)
    xn = torch.empty(1, H, dtype=bf, device=dev)
    yq, yk, yv = (torch.empty(1, n, dtype=bf, device=dev) for n in (H, KV, KV))
    ys = torch.empty(1, I, dtype=bf, device=dev)
    cnt3 = torch.zeros((H + 2 * KV) // 32, dtype=torch.int32, device=dev)
    cnt2 = torch.zeros(2 * I // 16, dtype=torch.int32, device=dev)
    part = torch.empty(S3 * (H + 2 * KV), dtype=torch.float32, device=dev)
    i32, u64 = np.int32, np.uint64
    eps_bits = i32(np.array([EPS], dtype=np.float32).view(np.int32)[0])
    p = lambda t: u64(t.data_ptr())

    def stream():
        return cupy.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream)

    def norm(xin, g, y, rows=1):
        f["dflash_rms_norm"]((rows, 1, 1), (128, 1, 1), (p(xin), p(g), p(y), i32(H), eps_bits), stream=stream())

    def qkv(xin, w, normed=None):
        if normed is None:
            f["dflash_gemm3_mt1"]((GX3, S3, 1), (128, 1, 1), (p(xin), p(w["q"]), p(w["k"]), p(w["v"]), p(cnt3), p(yq), p(yk),
                                                             p(yv), p(part), i32(1), i32(H), i32(H // S3), i32(S3),
                                                             i32(GX3), i32(H), i32(KV), i32(KV)), stream=stream())
        else:
            f["dflash_gemm3_norm_mt1"]((GX3, S3, 1), (128, 1, 1), (p(xin), p(normed), p(w["q"]), p(w["k"]), p(w["v"]),
                                                                  p(cnt3), p(yq), p(yk), p(yv), p(part), i32(1), i32(H),
                                                                  i32(H // S3), i32(S3), i32(GX3), i32(H), i32(KV),
                                                                  i32(KV), eps_bits), stream=stream())

    def swiglu(xin, w, normed=None):
        if normed is None:
            f["dflash_swiglu_mt1"]((GX2, S2, 1), (128, 1, 1), (p(xin), p(w["g"]), p(w["u"]), p(cnt2), p(ys), p(part), i32(1),
                                                              i32(H), i32(H), i32(S2), i32(GX2), i32(I)), stream=stream())
        else:
            f["dflash_swiglu_norm_mt1"]((GX2, S2, 1), (128, 1, 1), (p(xin), p(normed), p(w["g"]), p(w["u"]), p(cnt2), p(ys),
                                                                   p(part), i32(1), i32(H), i32(H), i32(S2), i32(GX2),
                                                                   i32(I), eps_bits), stream=stream())

    def layer(arm, w):
        if arm == "gemm":
            qkv(x, w), swiglu(x, w)
        elif arm == "norm+gemm":
            norm(x, w["n1"], xn), qkv(xn, w), norm(x, w["n2"], xn), swiglu(xn, w)
        else:
            qkv(x, w, w["n1"]), swiglu(x, w, w["n2"])

    # bits: the prologue against the norm's dispatch + the plain GEMM
    bits = []
    for s in range(SETS):
        w = ws[s]
        layer("norm+gemm", w)
        ref = [t.clone() for t in (yq, yk, yv)]
        norm(x, w["n2"], xn), swiglu(xn, w)
        ref.append(ys.clone())
        layer("prologue", w)
        got = [yq, yk, yv, ys]
        bits.append(sum(int((a.view(torch.int16) != b.view(torch.int16)).sum()) for a, b in zip(ref, got)))
    torch.cuda.synchronize()
    # the norm's rows: row 5 of a 16-row call == the one-row call on that row; against torch's float32 rule
    x16 = (torch.randn(16, H, device=dev) * 3).to(bf)
    y16 = torch.empty_like(x16)
    norm(x16, ws[0]["n1"], y16, rows=16)
    y1 = torch.empty(1, H, dtype=bf, device=dev)
    norm(x16[5:6].contiguous(), ws[0]["n1"], y1)
    torch.cuda.synchronize()
    xf = x16.float()
    ref_t = ws[0]["n1"] * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + EPS)).to(bf)
    norm_rows = {"row5_vs_one_row_differ": int((y16[5].view(torch.int16) != y1[0].view(torch.int16)).sum()),
                 "vs_torch_differ": int((y16.view(torch.int16) != ref_t.view(torch.int16)).sum()),
                 "vs_torch_max_ulp_gap": float((y16.float() - ref_t.float()).abs().max())}

    graphs = {}
    for arm in ("gemm", "norm+gemm", "prologue"):
        g = torch.cuda.CUDAGraph()
        s = torch.cuda.Stream()
        with torch.cuda.stream(s):
            layer(arm, ws[0])  # warm
            torch.cuda.synchronize()
            with torch.cuda.graph(g, stream=s):
                for li in range(LAYERS):
                    layer(arm, ws[li % SETS])
        graphs[arm] = g
    times = {a: [] for a in graphs}
    for _ in range(3):
        for arm, g in graphs.items():
            for _ in range(3):
                g.replay()
            torch.cuda.synchronize()
            ev = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
            t = []
            for _ in range(20):
                ev[0].record()
                g.replay()
                ev[1].record()
                torch.cuda.synchronize()
                t.append(ev[0].elapsed_time(ev[1]) * 1000 / LAYERS)  # us a layer
            times[arm].append(statistics.median(t))
    med = {a: statistics.median(v) for a, v in times.items()}
    res = {"card": torch.cuda.get_device_name(0), "regs": regs, "bits_differ_per_set": bits, "norm_rows": norm_rows,
           "us_per_layer_rounds": times, "us_per_layer": med,
           "prologue_cost_us_per_gemm": (med["prologue"] - med["gemm"]) / 2,
           "saved_us_per_norm_in_graph": (med["norm+gemm"] - med["prologue"]) / 2}
    print(json.dumps(res, indent=1))
    if json_out:
        json_out.write_text(json.dumps(res, indent=1) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build")
    b.add_argument("--out", type=Path, required=True)
    r = sub.add_parser("run")
    r.add_argument("--dir", type=Path, required=True)
    r.add_argument("--json", type=Path)
    a = ap.parse_args()
    build(a.out) if a.cmd == "build" else run(a.dir, a.json)


if __name__ == "__main__":
    main()
