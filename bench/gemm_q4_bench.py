"""The skinny GEMM's packed 4-bit form on one CUDA GPU, at Qwen3-8B shapes: bits against the bf16
kernel, row invariance, and time against the bytes it reads and against torch.compile.

    python bench/gemm_q4_bench.py prepare --out .gpu/q4 [--arch sm_80]      # here: compile the modules
    bash bench/on_device.sh python3 bench/gemm_q4_bench.py run --modules .gpu/q4 --json out.json   # there
    python bench/gemm_q4_bench.py report --json out.json                     # the markdown table

y[M, N] = x[M, K] . W[N, K]^T with W packed 4-bit as a checkpoint stores it (kernels/gemm `Q4`: MLX
affine group 64 for the timings; compressed-tensors symmetric and zero-point, group 128, for the
bits). Per shape and M:
- bits: the 4-bit kernel's y equals, bit for bit, the bf16 kernel's y on the weight dequantized by
  the NumPy reference (kernels/gemm/reference.py `dequantize_q4`, export/quantized.py's rule), with x
  and W's columns in the 4-bit kernel's k order (`q4_k_order`): the same chunks and instructions
  (gemm_body.h), so any difference is a dequantization bug;
- rows: one row of x placed at row 0 (M = 1) and row 5 (M = 16) gives the same bits;
- time per matmul as bench/gemm_bench.py measures it (R distinct weights of >= 384 MB together, one
  module call of PASSES passes less one of one pass), and its fraction of the copy bandwidth
  counting the bytes read: packed words, scales and biases;
- the peers: cuBLAS on the dequantized bf16 weight (its bytes: 4x), and torch.compile of the
  dequantize + matmul on the same packed tensors (the reference's float32 dequant, rounded to bf16),
  both in CUDA graphs.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

from common import copy_bandwidth, main, write_json

SHAPES = [(4096, 4096), (1024, 4096), (12288, 4096), (4096, 12288), (151936, 4096)]
NAMES = {(4096, 4096): "q/o proj", (1024, 4096): "k/v proj", (12288, 4096): "gate/up", (4096, 12288): "down",
         (151936, 4096): "lm_head"}
MS = [1, 16]
TIMED = ("mlx", 64)
BITS_ONLY = [("sym", 128), ("zp", 128)]  # checked for bits at the first shape only
SET_BYTES = 384 << 20
PASSES = 9
FLAGS = ["--iree-stream-partitioning-favor=debug"]


def reps(N: int, K: int) -> int:
    """Distinct packed weights an arm cycles through (together >= SET_BYTES of packed words)."""
    return max(2, -(-SET_BYTES // (N * K // 2)))


def _runner(fn: str, public: str, M: int, K: int, arg_ts: list[str], y_t: str, R: int, passes: int) -> str:
    X_t, x_t = f"tensor<{PASSES * M}x{K}xbf16>", f"tensor<{M}x{K}xbf16>"
    n = len(arg_ts)
    args = ", ".join(f"%a{i}_{j}: {t}" for i in range(R) for j, t in enumerate(arg_ts))
    lines = [f"util.func public @{public}(%X: {X_t}, {args}) -> ({', '.join([y_t] * (R * passes))}) {{"]
    for p in range(passes):
        lines.append(f"  %x{p} = tensor.extract_slice %X[{p * M}, 0] [{M}, {K}] [1, 1] : {X_t} to {x_t}")
        for i in range(R):
            ops = ", ".join(f"%a{i}_{j}" for j in range(n))
            lines.append(f"  %y{p}_{i} = util.call @{fn}(%x{p}, {ops}) : ({x_t}, {', '.join(arg_ts)}) -> {y_t}")
    rets = [f"%y{p}_{i}" for p in range(passes) for i in range(R)]
    lines.append(f"  util.return {', '.join(rets)} : {', '.join([y_t] * len(rets))}\n}}\n")
    return "\n".join(lines)


def case_name(M: int, N: int, K: int, fmt: str, group: int) -> str:
    return f"{fmt}{group}_{M}x{N}x{K}"


def case_text(M: int, N: int, K: int, arch: str, fmt: str, group: int, timed: bool) -> tuple[str, list[str], dict]:
    """One case's functions: {case}_q4_once / _q4_many (timed) and {case}_bf16_once (the bf16 kernel)."""
    from dflash_iree.kernels.gemm import Q4, gemm_dispatch

    c = case_name(M, N, K, fmt, group)
    q = Q4(fmt, group)
    d4 = gemm_dispatch(M, N, K, arch, name=f"q4_{c}", quant=q)
    d16 = gemm_dispatch(M, N, K, arch, name=f"b16_{c}")
    R = reps(N, K) if timed else 1
    y_t = f"tensor<{M}x{N}xbf16>"
    src = d4.mlir + d16.mlir + _runner(d16.func, f"{c}_bf16_once", M, K, [f"tensor<{N}x{K}xbf16>"], y_t, 1, 1)
    src += _runner(d4.func, f"{c}_q4_once", M, K, q.operand_types(N, K), y_t, R, 1)
    if timed:
        src += _runner(d4.func, f"{c}_q4_many", M, K, q.operand_types(N, K), y_t, R, PASSES)
    return src, d4.flags, {"splits": d4.plan.splits, "R": R, "fmt": fmt, "group": group}


def prepare(out: Path, arch: str) -> None:
    """One module per M (the kernel objects embedded once), every case's functions in it."""
    import iree.compiler as ic

    from dflash_iree.kernels.hal import device_flags

    out.mkdir(parents=True, exist_ok=True)
    meta = {"arch": arch, "cases": {}}
    cases = [(N, K, M, *TIMED, True) for N, K in SHAPES for M in MS]
    cases += [(*SHAPES[0], M, f, g, False) for f, g in BITS_ONLY for M in MS]
    for M in MS:
        src, flags = "", []
        for N, K, m, fmt, group, timed in cases:
            if m != M:
                continue
            text, flags, info = case_text(M, N, K, arch, fmt, group, timed)
            src += text
            meta["cases"][case_name(M, N, K, fmt, group)] = {"N": N, "K": K, "M": M, "timed": timed,
                                                             "module": f"q4_m{M}.vmfb", **info}
        t = time.time()
        ic.compile_str(src, output_file=str(out / f"q4_m{M}.vmfb"), extra_args=device_flags(arch) + flags + FLAGS)
        print(f"q4_m{M}.vmfb: {time.time() - t:.1f} s", flush=True)
    (out / "modules.json").write_text(json.dumps(meta, indent=1))


# ---------------------------------------------------------------- device side


def _packed(N: int, K: int, fmt: str, group: int, rng):
    """Random packed tensors of one weight as numpy arrays (q int32, s bf16 bits, o or None), scales
    about 1/64 and MLX biases about -8 scales, as a min-max quantizer would make them."""
    import numpy as np

    from dflash_iree.kernels.gemm.reference import bf16_bits

    g = K // group
    q = rng.integers(0, 2**32, size=(N, K // 8), dtype=np.uint64).astype(np.uint32).view(np.int32)
    s = bf16_bits((rng.random((N, g), dtype=np.float32) + 0.5) / 64)
    if fmt == "mlx":
        o = bf16_bits(-8 * (rng.random((N, g), dtype=np.float32) + 0.5) / 64)
    elif fmt == "zp":
        o = rng.integers(0, 2**32, size=(-(-N // 8), g), dtype=np.uint64).astype(np.uint32).view(np.int32)
    else:
        o = None
    return q, s, o


def _device_args(device, q, s, o):
    import iree.runtime as rt
    import ml_dtypes

    arrs = [rt.asdevicearray(device, q), rt.asdevicearray(device, s.view(ml_dtypes.bfloat16))]
    if o is not None:
        arrs.append(rt.asdevicearray(device, o.view(ml_dtypes.bfloat16) if o.dtype.name == "uint16" else o))
    return arrs


def _last(res):
    """A module function's last result (a function of one result returns it bare)."""
    return res[-1] if isinstance(res, (list, tuple)) else res


def _median_call(fn, args, n: int = 15) -> float:
    for _ in range(3):
        _last(fn(*args)).to_host()
    ts = []
    for _ in range(n):
        t = time.perf_counter()
        _last(fn(*args)).to_host()
        ts.append(time.perf_counter() - t)
    return statistics.median(ts)


def _torch_arms(x, q, s, o, group, N, K, wbf16, times: dict) -> None:
    """cuBLAS on the dequantized weight and torch.compile's dequantize + matmul (MLX form), CUDA graphs."""
    import torch
    from gemm_bench import _time_graph

    qt = torch.from_numpy(q).cuda()
    st = torch.from_numpy(s.view("int16")).cuda().view(torch.bfloat16)
    bt = torch.from_numpy(o.view("int16")).cuda().view(torch.bfloat16)
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device="cuda")

    def dq_mm(x, q, s, b):
        u = torch.bitwise_and(torch.bitwise_right_shift(q[..., None], shifts), 15).reshape(N, K // group, group)
        w = (s.float()[..., None] * u.float() + b.float()[..., None]).reshape(N, K).to(torch.bfloat16)
        return x @ w.t()

    compiled = torch.compile(dq_mm, dynamic=False)
    y_tc = compiled(x, qt, st, bt)
    times["torch_compile_us"] = _time_graph(lambda: compiled(x, qt, st, bt), 1) * 1e6
    times["torch_compile_y"] = y_tc
    times["cublas_us"] = _time_graph(lambda: x @ wbf16.t(), 1) * 1e6


def run(modules: Path, out_json: Path | None) -> dict:
    import iree.runtime as rt
    import ml_dtypes
    import numpy as np
    import torch

    from dflash_iree.kernels.gemm.dispatch import q4_fetch_chunks, q4_pair_order
    from dflash_iree.kernels.gemm.reference import bf16_bits, dequantize_q4, q4_k_order
    from gemm_bench import from_iree

    rec = {"copy": copy_bandwidth(), "rows": [], "row_check": []}
    bw = rec["copy"]["tb_per_s"]
    print(f"copy bandwidth {bw:.3f} TB/s on {rec['copy']['gpu']}", flush=True)
    meta = json.loads((modules / "modules.json").read_text())
    rec["arch"] = meta["arch"]
    config = rt.Config("cuda")
    rng = np.random.default_rng(0)
    probe, row_bits = {}, {}  # per weight: the probe row of x, and its output's bits at each M
    weights = {}
    mods = {}  # both modules stay loaded: a weight's M = 1 and M = 16 cases run on the same tensors
    order = sorted(meta["cases"].items(), key=lambda kv: (kv[1]["fmt"], kv[1]["N"], kv[1]["K"], kv[1]["M"]))
    for name, info in order:
        N, K, M, fmt, group, R = info["N"], info["K"], info["M"], info["fmt"], info["group"], info["R"]
        key = (N, K, fmt, group)
        if key not in weights:
            weights.clear()
            packs = [_packed(N, K, fmt, group, rng) for _ in range(R)]
            weights[key] = (packs, [_device_args(config.device, *p) for p in packs],
                            dequantize_q4(*packs[0], fmt, group, N, K))
            probe[key] = bf16_bits(rng.standard_normal(K, dtype=np.float32))
        packs, dargs, w_bits = weights[key]
        x_bits = bf16_bits(rng.standard_normal((PASSES * M, K), dtype=np.float32))
        row_at = 0 if M == 1 else 5
        x_bits[row_at] = probe[key]
        if info["module"] not in mods:
            vm = rt.VmModule.mmap(config.vm_instance, str(modules / info["module"]))
            ctx = rt.SystemContext(config=config)
            ctx.add_vm_module(vm)
            mods[info["module"]] = (ctx, vm)
        mod = mods[info["module"]][0].modules.module
        fn = lambda what: getattr(mod, f"{name}_{what}")  # noqa: E731
        dx = rt.asdevicearray(config.device, x_bits.view(ml_dtypes.bfloat16))
        res = fn("q4_once")(dx, *[a for d in dargs for a in d])
        y4 = np.asarray((res[0] if isinstance(res, (list, tuple)) else res).to_host()).view(np.uint16)
        k_order = q4_k_order(K, info["splits"], q4_fetch_chunks(meta["arch"]), q4_pair_order(meta["arch"]))
        dxp = rt.asdevicearray(config.device, np.ascontiguousarray(x_bits[:, k_order]).view(ml_dtypes.bfloat16))
        dw = rt.asdevicearray(config.device, np.ascontiguousarray(w_bits[:, k_order]).view(ml_dtypes.bfloat16))
        y16 = np.asarray(_last(fn("bf16_once")(dxp, dw)).to_host()).view(np.uint16)
        wbytes = sum(a.nbytes for a in packs[0] if a is not None)
        row = {"name": name, "N": N, "K": K, "M": M, "what": NAMES.get((N, K), ""), "fmt": fmt, "group": group,
               "splits": info["splits"], "R": R, "bytes_MB": wbytes / 1e6, "bits_equal": bool((y4 == y16).all()),
               "bits_differ": int((y4 != y16).sum())}
        row_bits.setdefault(key, []).append(y4[row_at].tobytes())
        if info["timed"]:
            args = [dx] + [a for d in dargs for a in d]
            t = (_median_call(fn("q4_many"), args) - _median_call(fn("q4_once"), args)) / (R * (PASSES - 1))
            row["q4_us"] = t * 1e6
            row["q4_frac"] = wbytes / t / 1e12 / bw
            xt = torch.from_numpy(x_bits[:M].view(np.int16)).cuda().view(torch.bfloat16)
            wt = torch.from_numpy(w_bits.view(np.int16)).cuda().view(torch.bfloat16)
            times = {}
            _torch_arms(xt, *packs[0], group, N, K, wt, times)
            row["torch_compile_us"], row["cublas_us"] = times["torch_compile_us"], times["cublas_us"]
            y_tc = times["torch_compile_y"].view(torch.int16).cpu().numpy().view(np.uint16)
            row["torch_compile_bits_equal_ours"] = bool((y_tc == y4[:M]).all())
            print(f"{name}: {t * 1e6:8.2f} us, {row['q4_frac']:.2f} of copy ({wbytes / 1e6:.1f} MB), torch.compile "
                  f"{row['torch_compile_us']:.2f} us, cuBLAS bf16 {row['cublas_us']:.2f} us, bits == bf16 kernel: "
                  f"{row['bits_equal']}", flush=True)
        else:
            print(f"{name}: bits == bf16 kernel: {row['bits_equal']} ({row['bits_differ']} differ)", flush=True)
        rec["rows"].append(row)
    for key, rows in row_bits.items():
        rec["row_check"].append({"shape": list(key), "placements": len(rows), "identical": len(set(rows)) == 1})
    if out_json:
        write_json(out_json, rec)
    return rec


def report(rec: dict) -> str:
    lines = [f"copy bandwidth {rec['copy']['tb_per_s']:.2f} TB/s ({rec['copy']['gpu']}), arch {rec['arch']}", "",
             "| weight | N x K | M | format | MB read | ours us | of copy | torch.compile us | cuBLAS bf16 us | bits == bf16 kernel |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rec["rows"]:
        t = lambda k: f"{r[k]:.2f}" if k in r else "-"  # noqa: E731
        frac = f"{r['q4_frac']:.2f}" if "q4_frac" in r else "-"
        lines.append(f"| {r['what']} | {r['N']}x{r['K']} | {r['M']} | {r['fmt']}/{r['group']} | {r['bytes_MB']:.1f} | "
                     f"{t('q4_us')} | {frac} | {t('torch_compile_us')} | {t('cublas_us')} | {r['bits_equal']} |")
    lines += ["", "one row at row 0 of M = 1 and row 5 of M = 16: " + ", ".join(
        f"{c['shape'][0]}x{c['shape'][1]} {c['shape'][2]}/{c['shape'][3]} {'identical' if c['identical'] else 'DIFFERENT'}"
        for c in rec["row_check"])]
    return "\n".join(lines)


def _options(p) -> None:
    p.add_argument("--arch", default="sm_80")
    p.add_argument("--out", "--modules", dest="modules", type=Path)
    p.add_argument("--json", type=Path)


if __name__ == "__main__":
    sys.exit(main(__doc__, {"prepare": (lambda a: prepare(a.modules, a.arch), _options),
                            "run": (lambda a: print(report(run(a.modules, a.json))), _options),
                            "report": (lambda a: print(report(json.loads(a.json.read_text()))), _options)}))
