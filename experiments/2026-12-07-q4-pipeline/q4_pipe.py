"""The 4-bit skinny GEMM's instruction stream and latency on an H100 or H200 (issue #28): variants of
kernels/gemm/gemm_gpu.cu's 4-bit object, built with clang defines from the sources of 9b81802 (which
carry every switch; the next commit keeps the chosen form only), launched directly through CuPy,
timed at M = 1 and 16, their bits checked against the committed bf16 kernel.

    .venv/bin/python experiments/2026-12-07-q4-pipeline/q4_pipe.py build --out .gpu/q4pipe [--run 2]   # here
    python3 experiments/2026-12-07-q4-pipeline/q4_pipe.py run --dir .gpu/q4pipe --json out.json   # there

The 2026-12-04 ncu run found the super-chunk kernel bound by issuing instructions (~49 a chunk in its
main loop by the local SASS count, sass_counts.txt) with a round's loads waited for before its
dequantization. Variants (each adds to the one before; `base` is the object committed at HEAD):
- st: a fused lop3 for the nibbles' mask and exponent (GM_QLOP3); x rows past M read row M - 1 with
  unpredicated loads (GM_XCLAMP: no zeroed registers); a fetch's loads straight-line, the scale and
  offset by predicated loads and a tile past N clamped (GM_QSTRAIGHT). Same bits as base.
- pipe: the next round's loads issued before this round is consumed (GM_QPIPE, one m-tile). Same bits.
- xlo0: with M <= 8, x's rows 8..15 not loaded (GM_QXLO). Same bits.
- xlo1: the 4-bit chunk's two matrix instructions take the lane's k-values {0,1,4,5} and {2,3,6,7}
  (GM_QPAIR_ORDER 1), so that x's 16-byte load is the first instruction's A operand as it came: other
  bits than base (the bf16 kernel's in another fixed k order, `perm` here).
- xlo1u2 / xlo1u8: 2 or 8 fetches a round.
Time per matmul from a CUDA graph over R distinct weights (>= 384 MB of packed words); "of copy"
counts packed words, scales and biases.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SHAPES = [(4096, 4096), (1024, 4096), (12288, 4096), (4096, 12288), (151936, 4096)]
TIMED_M = {(4096, 4096): (1, 16), (12288, 4096): (1, 16), (4096, 12288): (1, 16)}
GROUP = 64


def _on(*names: str) -> list[str]:
    """Every switch of the 4-bit path set: NAMES on, the rest off (independent of the sources' defaults)."""
    return [f"-D{s}={int(s in names)}" for s in ("GM_QLOP3", "GM_XCLAMP", "GM_QSTRAIGHT", "GM_QPIPE", "GM_QXLO",
                                                 "GM_QPAIR_ORDER")]


ST = ("GM_QLOP3", "GM_XCLAMP", "GM_QSTRAIGHT")
# Run 1 (q4_pipe_h100.json): 9b81802's sources, against the object committed before them (5ee1bd9,
# pair order 0).
VARIANTS_1 = {
    "st": _on(*ST),
    "pipe": _on(*ST, "GM_QPIPE"),
    "xlo0": _on(*ST, "GM_QPIPE", "GM_QXLO"),
    "xlo1": _on(*ST, "GM_QPIPE", "GM_QXLO", "GM_QPAIR_ORDER"),
    "xlo1u2": _on(*ST, "GM_QPIPE", "GM_QXLO", "GM_QPAIR_ORDER") + ["-DGM_UQ(MT)=2"],
    "xlo1u8": _on(*ST, "GM_QPIPE", "GM_QXLO", "GM_QPAIR_ORDER") + ["-DGM_UQ(MT)=8"],
}
# Run 2 (q4_xsm_<card>.json; built, not yet run): a8e5cd6's sources with xsm.patch, where at M > 8 x's 16
# rows are staged in shared memory a round ahead by cp.async (GM_QXSM) with 2 fetches a round
# (GM_QXSM_U; 4 spill), against a8e5cd6's object (run 1's xlo1).
VARIANTS_2 = {
    "xsm": ["-DGM_QXSM=1", "-DGM_QXSM_U=2"],
    "xsmu4": ["-DGM_QXSM=1", "-DGM_QXSM_U=4"],
}
RUNS = {1: {"sources": "9b81802", "base": "5ee1bd9", "base_pair_order": 0, "variants": VARIANTS_1},
        2: {"sources": "a8e5cd6", "patch": "xsm.patch", "base": "a8e5cd6", "base_pair_order": 1,
            "variants": VARIANTS_2}}


def build(out: Path, run: int) -> None:
    """RUN's variants from the kernel sources of the commit RUNS[run]["sources"] (with RUNS[run]["patch"],
    in this folder, applied), its base the 4-bit object committed at RUNS[run]["base"]."""
    sys.path.insert(0, str(ROOT))
    from dflash_iree.kernels.build import CLANG, targets
    from dflash_iree.kernels.gemm import gemm_plan

    spec = RUNS[run]
    _, folder, args = targets()["gemm_q4_sm_80.ptx"]
    out = out.resolve()
    out.mkdir(parents=True, exist_ok=True)

    def show(rev: str, path: str) -> bytes:
        return subprocess.run(["git", "show", f"{rev}:{path}"], cwd=ROOT, check=True, capture_output=True).stdout

    (out / "base.ptx").write_bytes(show(spec["base"], "kernels/objects/gemm_q4_sm_80.ptx"))
    (out / "bf16.ptx").write_bytes(show(spec["base"], "kernels/objects/gemm_sm_80.ptx"))
    meta = [{"name": "base", "file": "base.ptx", "defines": [], "qsc": 4, "pair_order": spec["base_pair_order"]}]
    with tempfile.TemporaryDirectory() as tmp:
        for path in (f"kernels/{folder}/gemm_body.h", f"kernels/{folder}/gemm_gpu.cu", "kernels/gpu.h"):
            dst = Path(tmp) / path
            dst.parent.mkdir(parents=True, exist_ok=True)
            dst.write_bytes(show(spec["sources"], path))
        if spec.get("patch"):
            subprocess.run(["git", "apply", str(Path(__file__).parent / spec["patch"])], cwd=tmp, check=True)
        src = Path(tmp) / "kernels"
        for name, defs in spec["variants"].items():
            subprocess.run([CLANG, *args, *defs, "-o", str(out / f"{name}.ptx")], cwd=src / folder, check=True)
            meta.append({"name": name, "file": f"{name}.ptx", "defines": defs, "qsc": 4,
                         "pair_order": int(run == 2 or "-DGM_QPAIR_ORDER=1" in defs)})
            print(name, flush=True)
    plans = {}
    for N, K in SHAPES:
        p = gemm_plan(N, K, "sm_80")
        plans[f"{N}x{K}"] = {"splits": p.splits, "grid_x": p.grid_x, "col_blocks": p.col_blocks}
    (out / "variants.json").write_text(json.dumps({"variants": meta, "plans": plans}, indent=1))


def perm(K: int, S: int, qsc: int, pair_order: int = 0):
    """Column order under which the bf16 kernel consumes k as the 4-bit kernel of QSC chunks a fetch
    does: p[j] = the original column at bf16 position j. pair_order 1: within a whole super-chunk, the
    lane's 8 k-values go to the bf16 kernel's positions 0, 1, 4, 5, 2, 3, 6, 7."""
    import numpy as np

    p = np.arange(K)
    if qsc == 1:
        return p
    sw = np.array([0, 1, 4, 5, 2, 3, 6, 7]) if pair_order else np.arange(8)
    KR, SC = K // S, 32 * qsc
    for s in range(S):
        for kb in range(s * KR, s * KR + (KR // SC) * SC, SC):
            for h in range(qsc):
                for t in range(4):
                    p[kb + 32 * h + 8 * t: kb + 32 * h + 8 * t + 8] = kb + 32 * t + 8 * h + sw
    return p


def run(d: Path, out_json: Path) -> None:
    import cupy
    import numpy as np
    import torch

    def copy_bandwidth(nbytes: int = 4 * 2**30) -> dict:
        """bench/common.py's: a device-to-device copy, 2 x bytes / median time (that module imports
        the package, which this script does not need installed)."""
        src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
        dst = torch.empty_like(src)
        ts = []
        for i in range(23):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            dst.copy_(src)
            b.record()
            torch.cuda.synchronize()
            if i >= 3:
                ts.append(a.elapsed_time(b) / 1e3)
        del src, dst
        torch.cuda.empty_cache()
        return {"bytes": nbytes, "median_ms": statistics.median(ts) * 1e3,
                "tb_per_s": round(2 * nbytes / statistics.median(ts) / 1e12, 3), "gpu": torch.cuda.get_device_name(0)}

    def _time_graph(fn, reps_inner: int, replays: int = 5) -> float:
        """bench/gemm_bench.py's: seconds per matmul from a CUDA graph of FN replayed REPLAYS times."""
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            fn()
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            fn()
        g.replay()
        torch.cuda.synchronize()
        ts = []
        for _ in range(replays):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            g.replay()
            b.record()
            torch.cuda.synchronize()
            ts.append(a.elapsed_time(b) / 1e3)
        return statistics.median(ts) / reps_inner

    meta = json.loads((d / "variants.json").read_text())
    bw = copy_bandwidth()
    rec = {"copy": bw, "rows": [], "bits": []}
    gen = torch.Generator(device="cuda").manual_seed(0)
    i32, u64 = np.int32, np.uint64
    mods = {v["name"]: cupy.RawModule(path=str(d / v["file"])) for v in meta["variants"]}
    bf16 = cupy.RawModule(path=str(d / "bf16.ptx")).get_function("dflash_gemm_mt1")

    def launch(f, args, grid):
        st = cupy.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream)
        f(grid, (128, 1, 1), args, stream=st)

    def buffers(M, N, plan):
        return (torch.empty(M, N, dtype=torch.bfloat16, device="cuda"),
                torch.empty(max(1, plan["splits"] * M * N), dtype=torch.float32, device="cuda"),
                torch.zeros(plan["col_blocks"], dtype=torch.int32, device="cuda"))

    def q4(f, x, q, s, o, N, K, plan, fmt, group, bufs=None):
        S, gx = plan["splits"], plan["grid_x"]
        M = x.shape[0]
        y, part, cnt = bufs or buffers(M, N, plan)
        launch(f, (u64(x.data_ptr()), u64(q.data_ptr()), u64(s.data_ptr()), u64(o.data_ptr()), u64(cnt.data_ptr()),
                   u64(y.data_ptr()), u64(part.data_ptr()), i32(M), i32(K), i32(K // S), i32(S), i32(gx), i32(N),
                   i32(fmt), i32(group)), (gx, S, 1))
        return y

    def b16(x, w, N, K, plan):
        S, gx, cb = plan["splits"], plan["grid_x"], plan["col_blocks"]
        M = x.shape[0]
        y = torch.empty(M, N, dtype=torch.bfloat16, device="cuda")
        part = torch.empty(max(1, S * M * N), dtype=torch.float32, device="cuda")
        cnt = torch.zeros(cb, dtype=torch.int32, device="cuda")
        launch(bf16, (u64(x.data_ptr()), u64(w.data_ptr()), u64(cnt.data_ptr()), u64(y.data_ptr()), u64(part.data_ptr()),
                      i32(M), i32(K), i32(K // S), i32(S), i32(gx), i32(N)), (gx, S, 1))
        return y

    def nibbles(q, N, K):
        sh = torch.arange(8, device="cuda", dtype=torch.int32) * 4
        return ((q.unsqueeze(-1) >> sh) & 15).reshape(N, K).float()

    def weights(N, K, fmt, group, dequantized=True):
        """Packed words, scales, offsets, and the dequantized bf16 W (export/quantized.py's rule)."""
        q = torch.randint(-2**31, 2**31 - 1, (N, K // 8), generator=gen, device="cuda", dtype=torch.int32)
        G = K // group
        s = ((torch.rand(N, G, generator=gen, device="cuda") + 0.5) / 64).to(torch.bfloat16)
        qv = nibbles(q, N, K)
        se = s.float().repeat_interleave(group, 1)
        if fmt == "mlx":  # mlx-lm's affine: the bias is the group's edge, q0 * s (q0 in -15..15), or 0
            q0 = torch.randint(-15, 16, (N, G), generator=gen, device="cuda").float()
            o = (q0 * s.float()).to(torch.bfloat16)
            if not dequantized:
                return q, s, o, None, 0
            w = (se * qv + o.float().repeat_interleave(group, 1)).to(torch.bfloat16)
            return q, s, o, w, 0
        if fmt == "sym":
            w = (se * (qv - 8)).to(torch.bfloat16)
            return q, s, s, w, 1
        z = torch.randint(0, 16, (N, G), generator=gen, device="cuda", dtype=torch.int32)
        zp = torch.zeros(-(-N // 8), G, dtype=torch.int32, device="cuda")
        for j in range(8):
            zz = z[j::8]
            zp[: zz.shape[0]] |= zz << (4 * j)
        w = (se * (qv - z.float().repeat_interleave(group, 1))).to(torch.bfloat16)
        return q, s, zp, w, 2

    # Bits, one shape per format, and every shape for MLX.
    for N, K in SHAPES:
        plan = meta["plans"][f"{N}x{K}"]
        for fmt, group in [("mlx", 64)] + ([("sym", 128), ("zp", 128), ("mlx", 32)] if (N, K) == (4096, 4096) else []):
            q, s, o, w, code = weights(N, K, fmt, group)
            x16 = torch.randn(16, K, generator=gen, device="cuda").to(torch.bfloat16)
            for v in meta["variants"]:
                f = mods[v["name"]].get_function("dflash_q4gemm_mt1")
                p = torch.from_numpy(perm(K, plan["splits"], v["qsc"], v["pair_order"])).cuda()
                ref = b16(x16[:, p].contiguous(), w[:, p].contiguous(), N, K, plan)
                vplan = plan
                y16 = q4(f, x16, q, s, o, N, K, vplan, code, group)
                y1 = q4(f, x16[5:6].contiguous(), q, s, o, N, K, vplan, code, group)
                torch.cuda.synchronize()
                row = {"variant": v["name"], "N": N, "K": K, "fmt": fmt, "group": group,
                       "differ_vs_bf16_kernel": int((y16.view(torch.int16) != ref.view(torch.int16)).sum()),
                       "row5_M16_vs_M1_differ": int((y16[5].view(torch.int16) != y1[0].view(torch.int16)).sum())}
                rec["bits"].append(row)
                print("bits", row, flush=True)
            del q, s, o, w
        torch.cuda.empty_cache()

    # Time, MLX group 64.
    for N, K in SHAPES:
        plan = meta["plans"][f"{N}x{K}"]
        R = max(2, math.ceil((384 << 20) / (N * K // 2)))
        ws = [weights(N, K, "mlx", GROUP, dequantized=False)[:3] for _ in range(R)]
        wbytes = N * K // 2 + 2 * 2 * N * K // GROUP
        cases = [(M, f"{N}x{K}") for M in TIMED_M.get((N, K), (1,))]
        for M, key in cases:
            x = torch.randn(M, K, generator=gen, device="cuda").to(torch.bfloat16)
            for v in meta["variants"]:
                plan = meta["plans"][key]
                bufs = buffers(M, N, plan)
                f = mods[v["name"]].get_function("dflash_q4gemm_mt1")
                t = _time_graph(lambda: [q4(f, x, *ws[i], N, K, plan, 0, GROUP, bufs) for i in range(R)], R)
                row = {"variant": v["name"], "N": N, "K": K, "M": M, "splits": plan["splits"], "us": t * 1e6,
                       "frac": wbytes / t / 1e12 / bw["tb_per_s"], "regs": f.num_regs, "local_bytes": f.local_size_bytes}
                rec["rows"].append(row)
                print(f"{v['name']:7s} M={M:2d} {N}x{K} S={plan['splits']}: {t * 1e6:8.2f} us, {row['frac']:.3f} of copy, "
                      f"regs {f.num_regs}, local {f.local_size_bytes}", flush=True)
        del ws
        torch.cuda.empty_cache()
    out_json.write_text(json.dumps(rec, indent=1) + "\n")


def profile(d: Path, variant: str, shape: str, calls: int = 5) -> None:
    """CALLS launches of VARIANT at SHAPE ("NxK"), M = 1, for ncu."""
    import cupy
    import numpy as np
    import torch

    meta = json.loads((d / "variants.json").read_text())
    plan = meta["plans"][shape]
    N, K = map(int, shape.split("/")[0].split("x"))
    f = cupy.RawModule(path=str(d / f"{variant}.ptx")).get_function("dflash_q4gemm_mt1")
    q = torch.randint(-2**31, 2**31 - 1, (N, K // 8), device="cuda", dtype=torch.int32)
    s = (torch.rand(N, K // GROUP, device="cuda") / 64).to(torch.bfloat16)
    x = torch.randn(1, K, device="cuda").to(torch.bfloat16)
    y = torch.empty(1, N, dtype=torch.bfloat16, device="cuda")
    part = torch.empty(max(1, plan["splits"] * N), dtype=torch.float32, device="cuda")
    cnt = torch.zeros(plan["col_blocks"], dtype=torch.int32, device="cuda")
    i32, u64 = np.int32, np.uint64
    for _ in range(calls):
        f((plan["grid_x"], plan["splits"], 1), (128, 1, 1),
          (u64(x.data_ptr()), u64(q.data_ptr()), u64(s.data_ptr()), u64(s.data_ptr()), u64(cnt.data_ptr()),
           u64(y.data_ptr()), u64(part.data_ptr()), i32(1), i32(K), i32(K // plan["splits"]), i32(plan["splits"]),
           i32(plan["grid_x"]), i32(N), i32(0), i32(GROUP)))
    torch.cuda.synchronize()


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("cmd", choices=("build", "run", "profile"))
    ap.add_argument("--variant", default="sc4u4p")
    ap.add_argument("--shape", default="12288x4096")
    ap.add_argument("--out", "--dir", dest="dir", type=Path, required=True)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--run", type=int, choices=sorted(RUNS), default=1, help="build: which run's variants")
    a = ap.parse_args()
    if a.cmd == "build":
        build(a.dir, a.run)
    elif a.cmd == "run":
        run(a.dir, a.json)
    else:
        profile(a.dir, a.variant, a.shape)
