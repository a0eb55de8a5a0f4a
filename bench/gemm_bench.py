"""Skinny GEMM (the verify/decode/draft matmuls) on one CUDA GPU: the custom dispatch against IREE's default
matmul and cuBLAS, at Qwen3-8B shapes, with parity and the row-independence bit check.

    python bench/gemm_bench.py prepare --out .gpu/gemm [--arch sm_80]        # here: compile the modules
    bash bench/on_device.sh python3 bench/gemm_bench.py run --modules .gpu/gemm --json out.json   # there
    python bench/gemm_bench.py report --json out.json                        # the markdown table
    python bench/gemm_bench.py prepare --groups --out .gpu/groups            # grouped dispatches and
    ... gemm_bench.py run --groups --modules .gpu/groups --json g.json       # epilogues (bench/gemm_groups.py)

y[M, N] = x[M, K] . W[N, K]^T, x/W/y bf16, f32 sums; (N, K) in SHAPES, M in MS. Per shape and M:
- custom:  kernels/gemm/dispatch.py's dispatch in an IREE module;
- default: IREE's own matmul of the same shape (linalg.generic: bf16 products summed in f32, then
           truncated to bf16, the form torch's bf16 mm lowers to), same module, same flags;
- cublas:  torch `x @ W.t()`, captured in a CUDA graph;
- raw:     (with --ptx DIR) the kernel objects launched directly through CuPy in a CUDA graph, for
           trying build variants without IREE (bench/gemm_raw.py).
Each arm reads R distinct weight matrices (together >= 384 MB, beyond the 60 MB L2) one after the
other. IREE arms: one module function calls the R matmuls once, another PASSES times (each pass with
other x rows), compiled with --iree-stream-partitioning-favor=debug so that the dispatches run one
after another as in a model (no overlap of independent matmuls); time per matmul =
(median(many) - median(once)) / (R * (PASSES - 1)), which cancels the per-invocation overhead. Weights are function arguments: device arrays uploaded once.
Bandwidth = weight bytes / time; the copy bandwidth is a torch copy of a 4 GiB buffer in the same run
(2 * bytes / time, common.copy_bandwidth; results before it timed 5 copies with CUDA events). Parity: every output against float32 sums (torch, TF32 off) rounded to bf16, in
bf16 ulps (pass: <= 1). Rows: one row of x placed at rows 0 (M=1), 5 (M=8, 16), 5, 37 and 63 (M=64)
gives bit-identical outputs.
"""

from __future__ import annotations

import hashlib
import json
import math
import statistics
import sys
import time
from pathlib import Path

from common import copy_bandwidth, main, write_json
SHAPES = [(4096, 4096), (1024, 4096), (12288, 4096), (4096, 12288), (151936, 4096)]
NAMES = {(4096, 4096): "q/o proj", (1024, 4096): "k/v proj", (12288, 4096): "gate/up", (4096, 12288): "down",
         (151936, 4096): "lm_head", (6144, 4096): "q+k+v (raw: as one weight)",
         (24576, 4096): "gate+up (raw: as one weight)"}
MS = [1, 8, 16, 64]
SET_BYTES = 384 << 20
FLAGS = ["--iree-stream-partitioning-favor=debug"]
PASSES = 9  # the "many" function's passes over the weights; "once" makes one


def reps(N: int, K: int) -> int:
    """How many distinct weights an arm cycles through (together at least SET_BYTES)."""
    return max(2, math.ceil(SET_BYTES / (N * K * 2)))


def _default_fn(M: int, N: int, K: int) -> str:
    x_t, w_t, y_t = f"tensor<{M}x{K}xbf16>", f"tensor<{N}x{K}xbf16>", f"tensor<{M}x{N}xbf16>"
    return f"""util.func private @iree_mm(%x: {x_t}, %w: {w_t}) -> {y_t} {{
  %z = arith.constant 0.0 : f32
  %e = tensor.empty() : tensor<{M}x{N}xf32>
  %f = linalg.fill ins(%z : f32) outs(%e : tensor<{M}x{N}xf32>) -> tensor<{M}x{N}xf32>
  %acc = linalg.generic {{indexing_maps = [affine_map<(m, n, k) -> (m, k)>, affine_map<(m, n, k) -> (n, k)>,
      affine_map<(m, n, k) -> (m, n)>], iterator_types = ["parallel", "parallel", "reduction"]}}
      ins(%x, %w : {x_t}, {w_t}) outs(%f : tensor<{M}x{N}xf32>) {{
  ^bb0(%a: bf16, %b: bf16, %c: f32):
    %a32 = arith.extf %a : bf16 to f32
    %b32 = arith.extf %b : bf16 to f32
    %p = arith.mulf %a32, %b32 : f32
    %s = arith.addf %c, %p : f32
    linalg.yield %s : f32
  }} -> tensor<{M}x{N}xf32>
  %ey = tensor.empty() : {y_t}
  %y = linalg.generic {{indexing_maps = [affine_map<(m, n) -> (m, n)>, affine_map<(m, n) -> (m, n)>],
      iterator_types = ["parallel", "parallel"]}} ins(%acc : tensor<{M}x{N}xf32>) outs(%ey : {y_t}) {{
  ^bb0(%a: f32, %o: bf16):
    %t = arith.truncf %a : f32 to bf16
    linalg.yield %t : bf16
  }} -> {y_t}
  util.return %y : {y_t}
}}
"""


def _runner(fn: str, public: str, M: int, N: int, K: int, R: int, passes: int) -> str:
    """@public(X [PASSES_MAX*M, K], w_0..w_{R-1}): PASSES passes over the R weights, pass p with rows
    [p*M, (p+1)*M) of X (equal calls would be folded into one); every result is returned (none dropped)."""
    x_t, w_t, y_t = f"tensor<{M}x{K}xbf16>", f"tensor<{N}x{K}xbf16>", f"tensor<{M}x{N}xbf16>"
    X_t = f"tensor<{PASSES * M}x{K}xbf16>"
    args = ", ".join(f"%w{i}: {w_t}" for i in range(R))
    lines = [f"util.func public @{public}(%X: {X_t}, {args}) -> ({', '.join([y_t] * (R * passes))}) {{"]
    for p in range(passes):
        lines.append(f"  %x{p} = tensor.extract_slice %X[{p * M}, 0] [{M}, {K}] [1, 1] : {X_t} to {x_t}")
        for i in range(R):
            lines.append(f"  %y{p}_{i} = util.call @{fn}(%x{p}, %w{i}) : ({x_t}, {w_t}) -> {y_t}")
    rets = [f"%y{p}_{i}" for p in range(passes) for i in range(R)]
    lines.append(f"  util.return {', '.join(rets)} : {', '.join([y_t] * len(rets))}\n}}\n")
    return "\n".join(lines)


def module_text(M: int, N: int, K: int, arch: str) -> tuple[str, list[str], dict]:
    """The bench module for one shape: custom_once/custom_many/default_once/default_many."""
    from dflash_iree.kernels.gemm import gemm_dispatch

    d = gemm_dispatch(M, N, K, arch, name="dg")
    R = reps(N, K)
    src = d.mlir + _default_fn(M, N, K)
    for arm, fn in (("custom", d.func), ("default", "iree_mm")):
        src += _runner(fn, f"{arm}_once", M, N, K, R, 1) + _runner(fn, f"{arm}_many", M, N, K, R, PASSES)
    return src, d.flags, {"splits": d.plan.splits, "col_blocks": d.plan.col_blocks, "R": R}


def prepare(out: Path, arch: str) -> None:
    import iree.compiler as ic

    from dflash_iree.kernels.topk import device_flags

    out.mkdir(parents=True, exist_ok=True)
    meta = {"arch": arch, "modules": {}}
    for N, K in SHAPES:
        for M in MS:
            src, flags, info = module_text(M, N, K, arch)
            name = f"mm_{M}x{N}x{K}.vmfb"
            t = time.time()
            ic.compile_str(src, output_file=str(out / name), extra_args=device_flags(arch) + flags + FLAGS)
            meta["modules"][f"{M}x{N}x{K}"] = {"file": name, **info}
            print(f"{name}: {time.time() - t:.1f} s, plan {info}", flush=True)
    (out / "modules.json").write_text(json.dumps(meta, indent=1))


# ---------------------------------------------------------------- device side


def to_iree(device, t):
    """A bf16 torch tensor as an IREE device array (through host memory, bit for bit)."""
    import iree.runtime as rt
    import ml_dtypes
    import torch

    return rt.asdevicearray(device, t.cpu().view(torch.int16).numpy().view(ml_dtypes.bfloat16))


def from_iree(array):
    """An IREE bf16 device array as a CUDA torch tensor, bit for bit."""
    import numpy as np
    import torch

    return torch.from_numpy(np.asarray(array.to_host()).view(np.int16).copy()).view(torch.bfloat16).cuda()


def ulps(a, b):
    """bf16 ulp distance between two bf16 torch tensors (sign-magnitude bits ordered)."""
    import torch

    def order(t):
        v = t.contiguous().view(torch.int16).to(torch.int32) & 0xFFFF
        return torch.where(v >= 0x8000, 0x8000 - v, v)

    return (order(a) - order(b)).abs()


def parity(y, ref, scale) -> dict:
    """y (bf16) against ref (f32 sums rounded to bf16). Outputs whose |ref| is at least 2^-8 of
    scale = |x| . |W|^T (no heavy cancellation) must be within 1 bf16 ulp; where the sum cancels, the
    f32 summation order alone moves the result by many ulps, so those must be within 2^-16 * scale
    (absolute) or within 1 ulp. Returns max ulp (well-conditioned outputs), count over 1 ulp there, and bad count."""
    import torch

    ul = ulps(y, ref)
    well = ref.float().abs() >= scale * 2.0**-8
    err = (y.float() - ref.float()).abs()
    bad = (ul > 1) & (~well) & (err > scale * 2.0**-16) | (well & (ul > 1))
    return {"max_ulp": int(ul[well].max()) if bool(well.any()) else 0, "over1": int((well & (ul > 1)).sum()),
            "bad": int(bad.sum()), "max_ulp_all": int(ul.max())}


def _time_graph(fn, reps_inner: int, replays: int = 5) -> float:
    """Seconds per call of FN (which issues reps_inner matmuls), from a CUDA graph replayed `replays` times."""
    import torch

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
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(replays):
        a.record()
        g.replay()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    return statistics.median(times) / reps_inner


def run(modules: Path | None, ptx_dir: Path | None, out_json: Path | None, shapes=None, ms=None) -> dict:
    import torch

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
    rec = {"copy": copy_bandwidth(), "rows": [], "raw": [], "row_check": []}
    bw = rec["copy"]["tb_per_s"]
    print(f"copy bandwidth {bw:.3f} TB/s on {rec['copy']['gpu']}", flush=True)
    meta = json.loads((modules / "modules.json").read_text()) if modules else None
    if meta:
        import iree.runtime as rt

        config = rt.Config("cuda")
        rec["arch"] = meta["arch"]
    raws = {}
    if ptx_dir:
        import gemm_raw

        for v in json.loads((ptx_dir / "variants.json").read_text()):
            raws[v["name"]] = (gemm_raw.Raw(ptx_dir / v["file"], v["threads"], v["bn"], v["round"], v.get("rows", 16)), v)
    gen = torch.Generator(device="cuda").manual_seed(0)
    for N, K in shapes or SHAPES:
        R = reps(N, K)
        ws = [torch.randn(N, K, generator=gen, device="cuda", dtype=torch.float32).to(torch.bfloat16) for _ in range(R)]
        wbytes = N * K * 2
        ctx = fns = None
        dws = None
        probe = torch.randn(K, generator=gen, device="cuda").to(torch.bfloat16)
        row_bits = {}
        for M in ms or MS:
            x = torch.randn(M, K, generator=gen, device="cuda").to(torch.bfloat16)
            pos = [0] if M == 1 else ([5] if M < 64 else [5, 37, 63])
            for p in pos:
                x[p] = probe
            ref = (x.float() @ ws[0].float().t()).to(torch.bfloat16)
            scale = x.float().abs() @ ws[0].float().abs().t()
            row = {"N": N, "K": K, "M": M, "what": NAMES.get((N, K), ""), "R": R, "weight_MB": wbytes / 1e6}

            def mm_all():
                for w in ws:
                    torch.matmul(x, w.t())
            t = _time_graph(mm_all, R)
            row["cublas_parity"] = parity(torch.matmul(x, ws[0].t()), ref, scale)
            row["cublas_us"] = t * 1e6
            row["cublas_frac"] = wbytes / t / 1e12 / bw
            for vname, (raw, v) in raws.items():
                if M not in v.get("ms", MS):
                    continue
                for splits, passes in [(s, p) for s in (v["splits"][f"{N}x{K}"] if "splits" in v
                                                         else raw.split_candidates(N, K)) for p in v.get("passes", [1])]:
                    go, S = raw.launcher(x, ws[0], M, N, K, splits, passes)
                    y = go()
                    torch.cuda.synchronize()
                    pr = parity(y, ref, scale)
                    # the output's bits: variants at the same splits must give the same sums (gemm_body.h)
                    y_bits = hashlib.sha1(y.view(torch.int16).cpu().numpy().tobytes()).hexdigest()[:16]
                    t = _time_graph(lambda: [go(w) for w in ws], R)
                    rr = {"variant": vname, "N": N, "K": K, "M": M, "splits": S, "passes": passes, "us": t * 1e6,
                          "frac": wbytes / t / 1e12 / bw, "regs": raw.regs(M), "y_sha1": y_bits, **pr}
                    rec["raw"].append(rr)
                    print(f"raw {vname:10s} {M:3d}x{N}x{K} S={S:3d} P={passes} {t * 1e6:9.2f} us {rr['frac']:.2f} of copy, regs {rr['regs']}, "
                          f"ulp max {rr['max_ulp']} (>1: {rr['over1']}, bad {rr['bad']})", flush=True)
            if meta:
                info = meta["modules"][f"{M}x{N}x{K}"]
                vm = rt.VmModule.mmap(config.vm_instance, str(modules / info["file"]))
                ctx = rt.SystemContext(config=config)
                ctx.add_vm_module(vm)
                mod = ctx.modules.module
                if dws is None:
                    dws = [to_iree(config.device, w) for w in ws]
                X = torch.cat([x] + [torch.randn(M, K, generator=gen, device="cuda").to(torch.bfloat16)
                                     for _ in range(PASSES - 1)])
                dx = to_iree(config.device, X)
                row.update(splits=info["splits"], col_blocks=info["col_blocks"])
                for arm in ("custom", "default"):
                    once, many = getattr(mod, f"{arm}_once"), getattr(mod, f"{arm}_many")
                    res = once(dx, *dws)
                    yt = from_iree(res[0])
                    pr = parity(yt, ref, scale)
                    row[f"{arm}_parity"] = pr
                    row[f"{arm}_max_ulp"] = pr["max_ulp"]
                    if arm == "custom":
                        for p in pos:
                            row_bits.setdefault(p if M > 1 else 0, []).append((M, yt[p].cpu().view(torch.int16).numpy().tobytes()))
                    t1, t2 = [], []
                    # A call returns before the device is done: reading its last (small) result back waits
                    # for it; that constant cost cancels in the difference.
                    for _ in range(3):
                        once(dx, *dws)[-1].to_host()
                        many(dx, *dws)[-1].to_host()
                    for _ in range(15):
                        s = time.perf_counter()
                        once(dx, *dws)[-1].to_host()
                        t1.append(time.perf_counter() - s)
                        s = time.perf_counter()
                        many(dx, *dws)[-1].to_host()
                        t2.append(time.perf_counter() - s)
                    t = (statistics.median(t2) - statistics.median(t1)) / (R * (PASSES - 1))
                    row[f"{arm}_us"] = t * 1e6
                    row[f"{arm}_frac"] = wbytes / t / 1e12 / bw
                    row[f"{arm}_call_overhead_us"] = (statistics.median(t1) - R * t) * 1e6
                del ctx, mod, vm
                print(f"{M:3d}x{N}x{K}: custom {row['custom_us']:8.2f} us ({row['custom_frac']:.2f} of copy, "
                      f"ulp {row['custom_max_ulp']}), IREE default {row['default_us']:8.2f} us "
                      f"({row['default_frac']:.2f}, ulp {row['default_max_ulp']}), cuBLAS {row['cublas_us']:8.2f} us "
                      f"({row['cublas_frac']:.2f})", flush=True)
            rec["rows"].append(row)
        if row_bits:
            allb = [b for lst in row_bits.values() for _, b in lst]
            ok = all(b == allb[0] for b in allb)
            rec["row_check"].append({"N": N, "K": K, "placements": sum(len(v) for v in row_bits.values()),
                                     "identical": ok})
            print(f"row independence {N}x{K}: {'identical' if ok else 'DIFFERENT'} over {len(allb)} placements",
                  flush=True)
        del ws, dws
        torch.cuda.empty_cache()
    if out_json:
        write_json(out_json, rec)
    return rec


def _copy_tb_per_s(rec: dict) -> float:
    return rec["copy"].get("tb_per_s", rec["copy"].get("TBps"))  # TBps: results written before common.py


def summary(rec: dict) -> dict:
    """verify(16)/decode(1) time ratios per shape and over one 8B layer + lm_head (weights as in Qwen3-8B)."""
    rows = {(r["N"], r["K"], r["M"]): r for r in rec["rows"]}
    out = {}
    # One Qwen3-8B layer: q, o (4096x4096), k, v (1024x4096), gate, up (12288x4096), down (4096x12288).
    layer = {(4096, 4096): 2, (1024, 4096): 2, (12288, 4096): 2, (4096, 12288): 1}
    for arm in ("custom", "default", "cublas"):
        key = f"{arm}_us"
        try:
            t = {M: sum(c * rows[(N, K, M)][key] for (N, K), c in layer.items()) for M in MS}
        except KeyError:
            continue
        byts = sum(c * N * K * 2 for (N, K), c in layer.items())
        out[arm] = {"layer_us": t, "verify16_decode1_ratio": t[16] / t[1], "verify8_decode1_ratio": t[8] / t[1],
                    "layer_frac_of_copy": {M: byts / (t[M] * 1e-6) / 1e12 / _copy_tb_per_s(rec) for M in MS}}
    return out


def report(rec: dict) -> str:
    lines = ["| N x K | what | M | custom µs | % copy | IREE default µs | % copy | cuBLAS µs | % copy | max ulp (custom/default) |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rec["rows"]:
        if "custom_us" not in r:
            continue
        lines.append(f"| {r['N']}x{r['K']} | {r['what']} | {r['M']} | {r['custom_us']:.1f} | {100 * r['custom_frac']:.0f} | "
                     f"{r['default_us']:.1f} | {100 * r['default_frac']:.0f} | {r['cublas_us']:.1f} | "
                     f"{100 * r['cublas_frac']:.0f} | {r['custom_max_ulp']}/{r['default_max_ulp']} |")
    return "\n".join(lines)


def _options(p) -> None:
    p.add_argument("--arch", default="sm_80")
    p.add_argument("--out", "--modules", dest="modules", type=Path)
    p.add_argument("--ptx", type=Path, help="folder with variants.json and PTX variants (raw CuPy arm, bench/gemm_raw.py)")
    p.add_argument("--json", type=Path)
    p.add_argument("--shapes", help="NxK,NxK,... (default: all)")
    p.add_argument("--ms", help="M,M,... (default: 1,8,16,64)")
    p.add_argument("--groups", action="store_true", help="the grouped dispatches and epilogues (bench/gemm_groups.py)")


def _prepare(a) -> None:
    if a.modules is None:
        raise SystemExit("prepare needs --out DIR")
    if a.groups:
        import gemm_groups

        gemm_groups.prepare_groups(a.modules, a.arch)
    else:
        prepare(a.modules, a.arch)


def _run(a) -> None:
    if a.groups:
        if a.modules is None:
            raise SystemExit("--groups needs --modules DIR (the grouped modules' folder)")
        import gemm_groups

        gemm_groups.run_groups(a.modules, a.json)
        return
    shapes = [tuple(int(v) for v in s.split("x")) for s in a.shapes.split(",")] if a.shapes else None
    ms = [int(m) for m in a.ms.split(",")] if a.ms else None
    rec = run(a.modules, a.ptx, a.json, shapes, ms)
    rec["summary"] = summary(rec)
    if a.json:
        write_json(a.json, rec)
    print(json.dumps(rec["summary"], indent=1))
    print(report(rec))


def _report(a) -> None:
    rec = json.loads(a.json.read_text())
    print(report(rec))
    print(json.dumps(summary(rec), indent=1))


if __name__ == "__main__":
    sys.exit(main(__doc__, {"prepare": (_prepare, _options), "run": (_run, _options), "report": (_report, _options)}))
