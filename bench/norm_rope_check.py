"""Bit parity of the head norm + rope dispatch (kernels/norm_rope/dispatch.py) with the eager PyTorch ops, on a GPU.

    python bench/norm_rope_check.py prepare --arch sm_80       # here: standalone modules into .gpu/norm_rope/
    make device-wheels && python bench/pack_device.py artifacts norm_rope   # .gpu/wheels, .gpu/artifacts.zip
    bash bench/on_device.sh python3 bench/norm_rope_check.py run --json OUT   # on the GPU machine

Each case (the Qwen3-8B q and k shapes of decode and verify, a dynamic token count, tiny float32,
float16; q and k in one dispatch, each output checked) runs the kernel on seeded inputs (cos, sin of real positions) and compares it with
export/qwen3.py's `apply_rope(rms_norm(x, w, eps), cos, sin)` in eager PyTorch on the CPU: the
share of bit-equal elements and the largest distance in units in the last place of the dtype.
The variant cases (Qwen3.5-27B's and the demo hybrid target's q and k: zero-centred, 64 of 256 and
16 of 64 dims rotated, q read in place from [H, 2 hd]; names end in `_zc_r{R}_s{X}`) compare with
export/qwen35.py's `partial_rope(zc_rms_norm(x, w, eps), cos, sin)` instead, cos and sin as
export/qwen35_rope.py computes them (plain RoPE over the first R dims, scaled by 1.0). The
two sum the squares in different orders, so the f32 scale may round differently and move the
normed value by one ulp (and each product after it by about as much); the rope's sum y*cos - y'*sin can cancel and carry that one ulp of each
term into many ulps of a small result. So an element passes at <= 1 ulp, or within 4 ulps of each
term's magnitude: |err| <= 4 eps (|y cos| + |y' sin|), with y the eager normed value (the dims a
partial rotary passes through: within 4 eps |y|, as the scale's rounding carries into them whole: in
float32, where no rounding to a narrower dtype absorbs it, a kernel-like scale, 1/sqrt over another
sum order, puts them up to 2.55 eps |y| from eager's rsqrt on this torch:
experiments/2026-12-05-hybrid-kernels-gpu/README.md); anything more is a bug. (Measured: bf16 and f16 bit-equal but 1 element in about 500k at 1 ulp; f32 is where the
cancellation shows.)

The KV cases (`norm_rope_kv_dispatch`, names starting `kv_`: the Qwen3-8B layer's decode, verify
and a dynamic token count, and tiny float32 with 2 streams) also write k's result and v into layer 1
of a KV cache [S, 2, 2, C, Hk * hd] filled with seeded values, at the rows export/qwen3.py
`cache_rows` gives T positions: q is checked as above; in the cache, k's rows as k's result is, and
every other element (v's rows, the rows not written, layer 0) must equal export/qwen3.py
`written_cache`'s bit for bit.
"""

from __future__ import annotations

import json
import sys

import common
from common import main, write_json

WORK = common.WORK / "norm_rope"
# (S, T, H, head_dim, dtype, eps[, Hk[, (rotary_dim, x_stride)]]); T None: a dynamic token count, run
# with DYNAMIC_T tokens; Hk: q (H heads) and k (Hk heads) in one dispatch (dflash_norm_rope2), each
# output checked (None: x alone); with the last, Qwen3.5's variant (dflash_norm_rope_v / 2_v):
# zero-centred, rotary_dim dims rotated, x [S, T, H, x_stride] of which each head's first head_dim.
CASES = [(1, 1, 32, 128, "bf16", 1e-6), (1, 1, 8, 128, "bf16", 1e-6), (1, 16, 32, 128, "bf16", 1e-6),
         (1, 16, 8, 128, "bf16", 1e-6), (1, None, 8, 128, "bf16", 1e-6), (1, 8, 4, 16, "f32", 1e-6),
         (1, 5, 4, 64, "f16", 1e-5), (1, 1, 32, 128, "bf16", 1e-6, 8), (1, 16, 32, 128, "bf16", 1e-6, 8),
         (1, None, 32, 128, "bf16", 1e-6, 8), (2, 8, 4, 16, "f32", 1e-6, 2),
         # Qwen3.5-27B (24 q, 4 kv heads, hd 256, 64 rotated): decode, verify, prefill, k alone, q alone
         (1, 1, 24, 256, "bf16", 1e-6, 4, (64, 512)), (1, 16, 24, 256, "bf16", 1e-6, 4, (64, 512)),
         (1, None, 24, 256, "bf16", 1e-6, 4, (64, 512)), (1, 16, 4, 256, "bf16", 1e-6, None, (64, 256)),
         (1, 16, 24, 256, "bf16", 1e-6, None, (64, 512)),
         # the demo hybrid target (6 q, 2 kv heads, hd 64, 16 rotated): decode, verify, f32, f16
         (1, 1, 6, 64, "bf16", 1e-6, 2, (16, 128)), (1, 8, 6, 64, "bf16", 1e-6, 2, (16, 128)),
         (1, 8, 6, 64, "f32", 1e-6, 2, (16, 128)), (1, 5, 6, 64, "f16", 1e-6, 2, (16, 128))]
# (S, T, H, Hk, head_dim, dtype, eps, C): the KV-writing dispatch, cache [S, 2, 2, C, Hk * head_dim], layer 1 written
KV_CASES = [(1, 1, 32, 8, 128, "bf16", 1e-6, 608), (1, 16, 32, 8, 128, "bf16", 1e-6, 608),
            (1, None, 32, 8, 128, "bf16", 1e-6, 608), (2, 8, 4, 2, 16, "f32", 1e-6, 64)]
DYNAMIC_T = 37
THETA = {256: 1e7, 64: 1e4}  # the variants' rope_theta by head_dim: Qwen3.5-27B's, the demo target's


def _heads(case) -> list[int]:
    """The heads of x, then of k where the case pairs them."""
    return [case[2]] + ([case[6]] if len(case) > 6 and case[6] is not None else [])


def _variant(case):
    """(rotary_dim, x_stride) of a variant case, else None."""
    return case[7] if len(case) > 7 else None


def _name(case) -> str:
    S, T, H, D, dtype = case[:5]
    v = _variant(case)
    tail = "" if v is None else f"_zc_r{v[0]}_s{v[1]}"
    return f"{S}x{'D' if T is None else T}x{'_'.join(map(str, _heads(case)))}x{D}_{dtype}{tail}"


def _kv_name(case) -> str:
    S, T, H, Hk, D, dtype, _, C = case
    return f"kv_{S}x{'D' if T is None else T}x{H}_{Hk}x{D}_{dtype}_c{C}"


def prepare(arch: str) -> None:
    """Compile one standalone module per case for ARCH into .gpu/norm_rope/."""
    import iree.compiler as ic

    from dflash_iree.export.compile import compile_flags, resolve_arch
    from dflash_iree.kernels.norm_rope import norm_rope_dispatch, norm_rope_kv_dispatch, standalone_module

    WORK.mkdir(parents=True, exist_ok=True)
    flags = compile_flags(resolve_arch(arch)[0])
    for case in CASES:
        v = _variant(case)
        Hk = case[6] if len(case) > 6 else None
        kw = {} if v is None else {"zero_centered": True, "rotary_dim": v[0], "x_stride": v[1]}
        d = norm_rope_dispatch(*case[:6], arch, Hk=Hk, **kw)
        ic.compile_str(standalone_module(d), extra_args=flags + d.flags, output_file=str(WORK / f"{_name(case)}.vmfb"))
    for case in KV_CASES:
        S, T, H, Hk, D, dtype, eps, C = case
        d = norm_rope_kv_dispatch(S, T, H, Hk, D, dtype, eps, (S, 2, 2, C, Hk * D), arch)
        ic.compile_str(standalone_module(d), extra_args=flags + d.flags, output_file=str(WORK / f"{_kv_name(case)}.vmfb"))
    (WORK / "cases.json").write_text(json.dumps({"arch": arch, "cases": CASES, "kv_cases": KV_CASES}) + "\n")


def _inputs(case, seed: int):
    """[(x [S, T, H, X], w [D]), and for a pair (k [S, T, Hk, D], wk [D])], cos, sin [S, T, R] in the
    case's dtype (torch, CPU). Qwen3: X = R = D, weights around 1. A variant: q's X its x_stride
    (k's D), R its rotary_dim, weights around 0 (zero-centred), the tables of export/qwen35_rope.py."""
    import torch

    from dflash_iree.export.qwen3 import rope_tables
    from dflash_iree.export.rope import cos_sin, inv_freq

    S, T, H, D, dtype = case[:5]
    T = DYNAMIC_T if T is None else T
    dt = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}[dtype]
    g = torch.Generator().manual_seed(seed)
    v = _variant(case)
    widths = [D] * len(_heads(case)) if v is None else [v[1]] + [D] * (len(_heads(case)) - 1)
    w0 = 1.0 if v is None else 0.0
    xs = [((torch.randn(S, T, h, X, generator=g) * 3).to(dt), (w0 + 0.3 * torch.randn(D, generator=g)).to(dt))
          for h, X in zip(_heads(case), widths)]
    positions = torch.randint(0, 4096, (S, T), generator=g)
    if v is None:
        cos, sin = rope_tables(positions, D, 1e6, dt)
    else:  # export/qwen35_rope.py `rope_tables` of a plain-RoPE config: the factor 1.0 multiplied all the same
        freq, scale = inv_freq(v[0], THETA[D])
        cos, sin = cos_sin(positions, freq, dt, scale)
    return xs, cos, sin


def _eager(case, x, w, cos, sin):
    """(the eager normed value y [S, T, H, D], the eager result) of the case's ops on x."""
    from dflash_iree.export.qwen3 import apply_rope, rms_norm
    from dflash_iree.export.qwen35 import partial_rope, zc_rms_norm

    D = w.shape[-1]
    if _variant(case) is None:
        y = rms_norm(x, w, case[5])
        return y, apply_rope(y, cos, sin)
    y = zc_rms_norm(x[..., :D], w, case[5])
    return y, partial_rope(y, cos, sin)


def _want(case, x, w, cos, sin):
    """The eager result of the case's ops on x, and each element's bound (the module docstring)."""
    import torch

    y, want = _eager(case, x, w, cos, sin)
    R = cos.shape[-1]
    half = R // 2
    swapped = torch.cat([y[..., half:R], y[..., :half]], -1).float()
    bound = 4 * torch.finfo(y.dtype).eps * (y[..., :R].float().abs() * cos[:, :, None].float().abs()
                                             + swapped.abs() * sin[:, :, None].float().abs())
    return want, torch.cat([bound, 4 * torch.finfo(y.dtype).eps * y[..., R:].float().abs()], -1)  # passed through


def _host(out, dtype):
    """An IREE result as a torch tensor of dtype (the bits moved as integers: NumPy has no bf16)."""
    import numpy as np
    import torch

    got = np.asarray(out.to_host())
    return torch.from_numpy(got.view({2: np.int16, 4: np.int32}[got.itemsize]).copy()).view(dtype)


def _device_input(t, np_dtype):
    """A torch tensor as the NumPy array IREE takes (`_host`'s inverse): its bits viewed as np_dtype."""
    import torch

    return t.contiguous().view({2: torch.int16, 4: torch.int32}[t.element_size()]).numpy().view(np_dtype)


def _count(row: dict, got, want, bound) -> None:
    """Add got's elements against want's to row: bit-equal, the largest ulp distance, and those past bound."""
    ulp = (_ordered(got) - _ordered(want)).abs()
    row["elements"] += ulp.numel()
    row["bit_equal"] += int((ulp == 0).sum())
    row["max_ulp"] = max(row["max_ulp"], int(ulp.max()))
    row["outside_bound"] += int(((ulp > 1) & ((got.float() - want.float()).abs() > bound)).sum())


def _run_kv(case, device, np_dtype) -> dict:
    """One KV case on the GPU (the module docstring): q's counts, and the cache's (k's rows bounded as
    q's elements are, every other element bit for bit against `written_cache`)."""
    import iree.runtime as rt

    instance = rt.VmInstance()
    vm = rt.VmModule.mmap(instance, str(WORK / f"{_kv_name(case)}.vmfb"))
    ctx = rt.VmContext(instance, modules=[rt.create_hal_module(instance, device), vm])
    invoke = rt.FunctionInvoker(ctx, device, vm.lookup_function("norm_rope"))
    return kv_check(case, lambda *host: invoke(*[rt.asdevicearray(device, h) for h in host]), np_dtype)


def kv_check(case, fn, np_dtype: dict) -> dict:
    """`_run_kv`'s counts with fn(*host arrays) -> (q out, cache out) standing for the compiled
    function (each result with `to_host()`); np_dtype maps the case's dtype to a NumPy one."""
    import torch

    from dflash_iree.export.qwen3 import cache_rows, written_cache

    S, T, H, Hk, D, dtype, eps, C = case
    T = DYNAMIC_T if T is None else T
    row = {"case": _kv_name(case), "elements": 0, "bit_equal": 0, "max_ulp": 0, "outside_bound": 0,
           "cache_elements": 0, "cache_not_equal": 0}
    pair = (S, T, H, D, dtype, eps, Hk)
    for seed in range(4):
        ((q, wq), (k, wk)), cos, sin = _inputs(pair, seed)  # cos, sin of other positions: the kernel takes any
        g = torch.Generator().manual_seed(100 + seed)
        v = torch.randn(S, T, Hk, D, generator=g).to(q.dtype)
        cache = torch.randn(S, 2, 2, C, Hk * D, generator=g).to(q.dtype)
        start = int(torch.randint(0, C - T + 1, (1,), generator=g))
        positions = torch.arange(start, start + T).expand(S, T)
        rows = cache_rows(cache, positions)[1].contiguous()
        host = [_device_input(t, np_dtype[dtype]) for t in (q, wq, k, wk, cos, sin, v)]
        outs = fn(*host, rows.numpy(), _device_input(cache, np_dtype[dtype]))
        q_want, q_bound = _want(pair, q, wq, cos, sin)
        _count(row, _host(outs[0], q.dtype), q_want, q_bound)
        k_want, k_bound = _want(pair, k, wk, cos, sin)
        want = written_cache(cache, rows, k_want, v)
        zeros = torch.zeros_like(cache, dtype=torch.float32)
        bound = written_cache(zeros, rows, k_bound, torch.zeros_like(v, dtype=torch.float32))
        k_rows = written_cache(zeros, rows, torch.ones_like(k_bound), torch.zeros_like(v, dtype=torch.float32)) != 0
        got = _host(outs[1], q.dtype)
        _count(row, got, want, bound)
        row["cache_elements"] += got.numel()
        row["cache_not_equal"] += int(((_ordered(got) != _ordered(want)) & ~k_rows).sum())
    row["ok"] = row["outside_bound"] == 0 and row["cache_not_equal"] == 0
    return row


def _ordered(t):
    """The bits of a float tensor as integers in value order (sign-magnitude), for ulp distances."""
    import torch

    bits = {2: torch.int16, 4: torch.int32}[t.element_size()]
    v = t.contiguous().view(bits).to(torch.int64)
    top = 1 << (8 * t.element_size() - 1)
    v = v & ((top << 1) - 1)
    return torch.where(v >= top, top - v, v)


def run(out_json: str) -> dict:
    import iree.runtime as rt
    import ml_dtypes
    import numpy as np
    import torch

    meta = json.loads((WORK / "cases.json").read_text())
    device = rt.get_device("cuda")
    np_dtype = {"f32": np.float32, "bf16": ml_dtypes.bfloat16, "f16": np.float16}
    result = {"device": torch.cuda.get_device_name(0), "arch": meta["arch"], "cases": []}
    for case in map(tuple, meta["cases"]):
        instance = rt.VmInstance()
        vm = rt.VmModule.mmap(instance, str(WORK / f"{_name(case)}.vmfb"))
        ctx = rt.VmContext(instance, modules=[rt.create_hal_module(instance, device), vm])
        fn = rt.FunctionInvoker(ctx, device, vm.lookup_function("norm_rope"))
        row = {"case": _name(case), "elements": 0, "bit_equal": 0, "max_ulp": 0, "outside_bound": 0}
        for seed in range(4):
            xs, cos, sin = _inputs(case, seed)
            host = [_device_input(t, np_dtype[case[4]]) for t in [v for xw in xs for v in xw] + [cos, sin]]
            outs = fn(*[rt.asdevicearray(device, h) for h in host])
            outs = outs if isinstance(outs, (tuple, list)) else [outs]
            for (x, w), out in zip(xs, outs):
                want, bound = _want(case, x, w, cos, sin)
                _count(row, _host(out, want.dtype), want, bound)
        row["ok"] = row["outside_bound"] == 0
        result["cases"].append(row)
        print(row, flush=True)
    for case in map(tuple, meta.get("kv_cases", [])):
        row = _run_kv(case, device, np_dtype)
        result["cases"].append(row)
        print(row, flush=True)
    result["ok"] = all(r["ok"] for r in result["cases"])
    write_json(out_json, result)
    return result


if __name__ == "__main__":
    sys.exit(main(__doc__, {"prepare": (lambda a: prepare(a.arch), lambda p: p.add_argument("--arch", default="sm_80")),
                            "run": (lambda a: 0 if run(a.json)["ok"] else 1,
                                    lambda p: p.add_argument("--json", default=str(WORK / "norm_rope.json")))}))
