"""Attention alone at the Qwen3-8B shapes on a GPU: formulations of export/qwen3.py's `attend`; and the
gated block attention at the Qwen3.5 family's shapes (`prepare-gated`, `run-gated`, below).

    python bench/attention_bench.py prepare [--arch sm_80]        # here: one .vmfb per (variant, rows)
    bash bench/on_device.sh python3 bench/attention_bench.py run --json OUT   # on the GPU machine
    python bench/attention_bench.py prepare-gated [--arch sm_80]  # here: .gpu/attention-gated/
    bash bench/on_device.sh python3 bench/attention_bench.py run-gated --json OUT   # on the GPU machine

The H200 profile of the 8B verify step (experiments/2026-11-30-verify-profile/) put 9 of its
16.5 busy ms in attention: per layer a `matmul_like_16x8x4x128xD` dispatch of 0.21 ms and a softmax
of 0.05 ms, for 16 query rows over ~540 cached rows (1 MB of K and of V), where decode's whole
attention costs 0.05 ms a layer. Each module here runs one formulation over all 36 layers of a
KV cache [1, 36, 2, 1024, 1024] bf16 (argument, uploaded once; the model's layout), reading
`pages.shape[0] * 32` rows as the model does, for T = 16 (verify) and T = 1 (decode) query rows:

- `matmul`: export/qwen3.py `attend_matmul`, `attend` as it was (and the CPU's form now): queries
  [S, Hkv, g, T, hd] against keys broadcast over the g query heads of a group, a float32 softmax
  between two matmuls (the results files call it `current`: they were measured before the GPU
  archs took `sdpa`);
- `grouped`: the g heads of a group folded into the rows, [S*Hkv, T*g, hd] @ [S*Hkv, hd, N], two
  plain batch matmuls with no broadcast;
- `sdpa`: the same layout through `F.scaled_dot_product_attention` with a boolean mask, which
  IREE lowers to its fused attention op; `sdpa_gt` with the rows of a group ordered (g, T), and
  `sdpa_bias` with an additive float mask;
- `sdpa_rows4`, `sdpa_rows8`, `sdpa_rows16` (T = 16 only): `sdpa` with IREE's configuration for the
  attention op changed by a transform-dialect library to put 4, 8 or 16 query rows in a workgroup
  instead of one (IREE 3.13 gives the CUDA attention op one row a workgroup, no tensor cores);
- `attend`: export/qwen3.py `attend` itself (what GPU archs export: `sdpa` with the mask's rows
  selected), and `kernel`: the model's `cache_attention` with export/lower_attention.py applied (at T = 1 too,
  for the comparison; `make compile` keeps IREE's op below ATTENTION_MIN_ROWS rows), which swaps
  the op for kernels/attention/dispatch.py's block attention reading the cache in place.

`run` reports per module the wall ms per call (36 layers), the device busy ms and kernels per call
(CUPTI through torch.profiler, copies left out), and the largest difference from the first
variant's output (`max_abs_diff_vs_first`; `max_abs_diff_vs_current` in the files written before
the rename). From this version on it also reports the largest difference from a float32 PyTorch
reference on the GPU (`max_abs_diff_vs_torch_f32`) and, at T = 1 (the T = 16 block's first token),
whether the output is bit-identical to row 0 of the T = 16 output (`row0_bits_equal_t16`): the
row-independence `exact` mode relies on. Files before it used a [36, 2, 1024, 1024] cache.

Gated (`prepare-gated`, `run-gated`): export/qwen35.py's `gated_cache_attention` over GATED_LAYERS
layers of a cache [1, GATED_LAYERS, 2, 1024, Hkv * hd] bf16, at START, for GATED_SHAPES: the
Qwen3.5-27B (Hq 24, Hkv 4, hd 256: verify R = 96, decode R = 6), the 9B (Hq 16, Hkv 4, hd 256:
verify R = 64, decode R = 4) and the hybrid demo target (Hq 6, Hkv 2, hd 64, block 8: R = 24,
decode R = 3). `kernel` is the gated block attention (export/lower_attention.py), `iree` the same
module with every op left to IREE (its attention op times the eager sigmoid). Per shape `run-gated`
reports wall and busy ms per call (GATED_LAYERS layers) for both, and for the kernel the bit checks:
- `gate_rule`: the output against kernels/attention/reference.py `gate_output` applied to the
  kernel's own ungated result (the same call with the gate at +64, where sigmoid is exactly 1):
  elements whose bits differ and the largest distance in bf16 ulps (near-ties of the sigmoid's
  2^x only: expect 0 or a few, at most 1 ulp);
- `o_vs_reference`: the ungated result against the float64 reference rounded to bf16 (elements
  that differ; max ulps; max abs diff): the f32 sums' rounding, 1 ulp at near-ties;
- `vs_reference`: the gated output against the reference's whole rule (`attention(..., gate=)`);
- `row0_bits_equal_verify` (decode shapes): the decode output equal bit for bit to row 0 (token 0)
  of the verify output at the same position: the row invariance `exact` mode relies on;
- `max_abs_diff_iree`: the kernel against IREE's op.
"""

from __future__ import annotations

import functools
import statistics
import sys
import time

import common
from common import main, write_json

WORK = common.WORK / "attention"
LAYERS, CONTEXT, HQ, HKV, HD = 36, 1024, 32, 8, 128
PAGE = 32
START = 512  # committed rows before the block: the 8B speed bench's prompt
VARIANTS = ("matmul", "grouped", "sdpa", "sdpa_gt", "sdpa_bias", "sdpa_rows4", "sdpa_rows8", "sdpa_rows16", "attend",
            "kernel")
ROWS = (16, 1)


def _grouped(q, k, v, visible):
    import torch

    S, T, Hq, hd = q.shape
    N, Hkv = k.shape[1], k.shape[2]
    g = Hq // Hkv
    qg = q.reshape(S, T, Hkv, g, hd).permute(0, 2, 1, 3, 4).reshape(S * Hkv, T * g, hd)
    kt = k.permute(0, 2, 3, 1).reshape(S * Hkv, hd, N)
    scores = torch.bmm(qg, kt).float() * (hd**-0.5)
    mask = visible[:, None, :, None, :].expand(S, Hkv, T, g, N).reshape(S * Hkv, T * g, N)
    probs = torch.softmax(scores.masked_fill(~mask, float("-inf")), -1).to(v.dtype)
    out = torch.bmm(probs, v.permute(0, 2, 1, 3).reshape(S * Hkv, N, hd))
    return out.reshape(S, Hkv, T, g, hd).permute(0, 2, 1, 3, 4).reshape(S, T, Hq * hd)


def _sdpa(q, k, v, visible, order: str = "tg", bias: bool = False):
    """One `scaled_dot_product_attention` with the g heads of a KV group as rows, ordered (T, g) or
    (g, T), and a boolean mask or (bias) an additive float one of 0 / -inf."""
    import torch
    import torch.nn.functional as F

    S, T, Hq, hd = q.shape
    N, Hkv = k.shape[1], k.shape[2]
    g = Hq // Hkv
    if order == "tg":
        qg = q.reshape(S, T, Hkv, g, hd).permute(0, 2, 1, 3, 4).reshape(S, Hkv, T * g, hd)
    else:
        qg = q.reshape(S, T, Hkv, g, hd).permute(0, 2, 3, 1, 4).reshape(S, Hkv, g * T, hd)
    mask = torch.zeros(visible.shape, dtype=q.dtype).masked_fill(~visible, float("-inf")) if bias else visible
    if order == "tg":
        mask = mask[:, None, :, None, :].expand(S, Hkv, T, g, N).reshape(S, Hkv, T * g, N)
    else:
        mask = mask[:, None, None].expand(S, Hkv, g, T, N).reshape(S, Hkv, g * T, N)
    out = F.scaled_dot_product_attention(qg, k.permute(0, 2, 1, 3), v.permute(0, 2, 1, 3), attn_mask=mask)
    if order == "tg":
        return out.reshape(S, Hkv, T, g, hd).permute(0, 2, 1, 3, 4).reshape(S, T, Hq * hd)
    return out.reshape(S, Hkv, g, T, hd).permute(0, 3, 1, 2, 4).reshape(S, T, Hq * hd)


# A transform-dialect library (`--iree-codegen-transform-dialect-library=FILE@__kernel_config`)
# that gives the 16-row attention op IREE's own configuration for it, but with ROWS of the g
# query heads (and T_ROWS tokens) in one workgroup instead of one row.
_ROWS_SPEC = """module attributes {{ transform.with_named_sequence }} {{
  transform.named_sequence @apply(%op: !transform.any_op {{transform.readonly}},
      %config: !transform.any_param {{transform.readonly}}, %decomp: !transform.any_param {{transform.readonly}}) {{
    transform.annotate %op "compilation_info" = %config : !transform.any_op, !transform.any_param
    transform.annotate %op "decomposition_config" = %decomp : !transform.any_op, !transform.any_param
    transform.yield
  }}
  transform.named_sequence @match(%op: !transform.any_op {{transform.readonly}})
      -> (!transform.any_op, !transform.any_param, !transform.any_param) {{
    transform.match.operation_name %op ["iree_linalg_ext.attention", "iree_linalg_ext.online_attention"] : !transform.any_op
    %q = transform.get_operand %op[0] : (!transform.any_op) -> !transform.any_value
    transform.iree.match.cast_compatible_type %q = tensor<1x16x8x4x128xbf16> : !transform.any_value
    %config = transform.param.constant #iree_codegen.compilation_info<
      lowering_config = #iree_gpu.lowering_config<{{partial_reduction = [0, 0, 0, 0, 0, 0, 128], workgroup = [1, 1, {t_rows}, {rows}, 32, 0, 0]}}>,
      translation_info = #iree_codegen.translation_info<pipeline = #iree_gpu.pipeline<VectorDistribute> workgroup_size = [256, 1, 1] subgroup_size = 32>> -> !transform.any_param
    %decomp = transform.param.constant {{
      qk_attrs = {{lowering_config = #iree_gpu.lowering_config<{{lane_basis = [[1, 1, 1, 1, 1, 2, 16], [3, 0, 1, 2, 5, 6]], subgroup_basis = [[1, 1, 1, 1, 1, 1, 8], [0, 1, 2, 3, 4, 6]], thread = [0, 0, 0, 0, 8, 0]}}>}},
      pv_attrs = {{lowering_config = #iree_gpu.lowering_config<{{lane_basis = [[1, 1, 1, 1, 1, 2, 16], [3, 0, 1, 2, 5, 6]], subgroup_basis = [[1, 1, 1, 1, 1, 1, 8], [0, 1, 2, 3, 5, 6]], thread = [0, 0, 0, 0, 8, 0]}}>}}
    }} -> !transform.any_param
    transform.yield %op, %config, %decomp : !transform.any_op, !transform.any_param, !transform.any_param
  }}
  transform.named_sequence @__kernel_config(%variant: !transform.any_op {{transform.consumed}}) {{
    transform.foreach_match in %variant @match -> @apply : (!transform.any_op) -> !transform.any_op
    transform.yield
  }}
}}
"""
ROW_TILES = {"sdpa_rows4": (1, 4), "sdpa_rows8": (2, 4), "sdpa_rows16": (4, 4)}  # (tokens, heads) a workgroup


def _fn(variant: str):
    from dflash_iree.export.qwen3 import attend, attend_matmul

    if variant in ROW_TILES:
        return _sdpa
    return {"attend": attend, "kernel": None, "matmul": attend_matmul, "grouped": _grouped, "sdpa": _sdpa,
            "sdpa_gt": functools.partial(_sdpa, order="gt"), "sdpa_bias": functools.partial(_sdpa, bias=True)}[variant]


def layers_module(fn, layers: int = LAYERS, hkv: int = HKV, hd: int = HD, page: int = PAGE):
    """`fn` (an attention of export/qwen3.py's `attend` signature) over every layer of a KV cache
    laid out as export/qwen3.py `write_cache` lays it, or with `fn` None the model's own
    `cache_attention` (its cache read and the named op `dflash::block_attention`, which `prepare`
    lowers onto the kernel): forward(q [layers, 1, T, Hq, hd] bf16,
    cache [1, layers, 2, C, hkv * hd] bf16, start [1] int64, pages [P] int8) -> [layers, 1, T, Hq * hd],
    reading P * page cache rows with the causal mask of tokens at start.. (tests/test_attention.py
    has the same at tiny sizes)."""
    import torch
    from torch import nn

    from dflash_iree.export.qwen3 import cache_attention

    class Layers(nn.Module):
        def forward(self, q, cache, start, pages):
            read_len = pages.shape[0] * page
            positions = start[:, None] + torch.arange(q.shape[2], dtype=torch.int64)
            visible = torch.arange(read_len, dtype=torch.int64)[None, None, :] <= positions[:, :, None]
            outs = []
            for layer in range(layers):
                if fn is None:
                    outs.append(cache_attention(q[layer], cache, layer, read_len, positions, "fused"))
                    continue
                k = cache[:, layer, 0, :read_len].view(1, read_len, hkv, hd)
                v = cache[:, layer, 1, :read_len].view(1, read_len, hkv, hd)
                outs.append(fn(q[layer], k, v, visible))
            return torch.stack(outs)

    return Layers()


def _module(variant: str):
    return layers_module(_fn(variant))


def prepare(arch: str, variants=VARIANTS, rows=ROWS) -> None:
    import iree.turbine.aot as aot
    import torch

    from dflash_iree.export.compile import compile_flags, iree_compile_tool, resolve_arch

    import subprocess

    a = resolve_arch(arch)[0]
    WORK.mkdir(parents=True, exist_ok=True)
    pages = torch.export.Dim("P", min=1, max=CONTEXT // PAGE)
    for variant in variants:
        for T in rows:
            q = torch.zeros(LAYERS, 1, T, HQ, HD, dtype=torch.bfloat16)
            cache = torch.zeros(1, LAYERS, 2, CONTEXT, HKV * HD, dtype=torch.bfloat16)
            args = (q, cache, torch.tensor([START]), torch.zeros(18, dtype=torch.int8))
            out = aot.export(_module(variant), args=args, dynamic_shapes={"q": None, "cache": None, "start": None,
                                                                          "pages": {0: pages}})
            mlir = WORK / f"{variant}-t{T}.mlir"
            out.save_mlir(mlir)
            vmfb = WORK / f"{variant}-t{T}-{a.name}.vmfb"
            extra = []
            if variant == "kernel":
                from dflash_iree.export.splice import lower_attention, splice_file

                spliced, extra, report = splice_file(mlir, WORK / f"{variant}-t{T}.mlirbc", a.name,
                                                     {"attention": functools.partial(lower_attention, min_rows=1)})
                if "attention" not in report:
                    raise SystemExit(f"kernel: the block attention was not placed: {report.get('iree')}")
                mlir.unlink()
                mlir = spliced
            if variant in ROW_TILES:
                spec = WORK / f"{variant}.spec.mlir"
                t_rows, rows = ROW_TILES[variant]
                spec.write_text(_ROWS_SPEC.format(t_rows=t_rows, rows=rows))
                extra = [f"--iree-codegen-transform-dialect-library={spec}@__kernel_config"]
            proc = subprocess.run([iree_compile_tool(), str(mlir), *compile_flags(a), *extra, "-o", str(vmfb)],
                                  capture_output=True, text=True)
            mlir.unlink()
            status = "ok" if proc.returncode == 0 else "failed: " + proc.stderr.strip().splitlines()[-1][:200]
            print(f"{variant} T={T}: {status}", flush=True)


def _torch_reference(q, cache, start: int, n: int):
    """Float32 attention on the GPU (torch) for q [LAYERS, 1, T, HQ, HD] at positions start.. over the
    first n rows of cache [1, LAYERS, 2, C, HKV * HD]: [LAYERS, 1, T, HQ * HD] float32 (NumPy)."""
    import numpy as np
    import torch

    T = q.shape[2]
    qt = torch.from_numpy(np.asarray(q, np.float32)).cuda()
    kv = torch.from_numpy(np.asarray(cache[0, :, :, :n], np.float32)).cuda()  # LAYERS, 2, n, HKV*HD
    k = kv[:, 0].view(LAYERS, n, HKV, HD).repeat_interleave(HQ // HKV, 2).permute(0, 2, 3, 1)  # L, HQ, HD, n
    v = kv[:, 1].view(LAYERS, n, HKV, HD).repeat_interleave(HQ // HKV, 2).permute(0, 2, 1, 3)  # L, HQ, n, HD
    s = torch.matmul(qt[:, 0].permute(0, 2, 1, 3), k) * HD**-0.5  # L, HQ, T, n
    visible = torch.arange(n, device="cuda")[None, :] <= (start + torch.arange(T, device="cuda"))[:, None]
    p = torch.softmax(s.masked_fill(~visible, float("-inf")), -1)
    out = torch.matmul(p, v).permute(0, 2, 1, 3).reshape(LAYERS, 1, T, HQ * HD)
    return out.cpu().numpy()


def run(out_json: str, arch: str) -> dict:
    import iree.runtime as rt
    import ml_dtypes
    import numpy as np
    import torch

    device = rt.get_device("cuda")
    rng = np.random.default_rng(0)
    cache_h = (rng.standard_normal((1, LAYERS, 2, CONTEXT, HKV * HD)) * 0.5).astype(ml_dtypes.bfloat16)
    cache = rt.asdevicearray(device, cache_h)
    start = np.array([START], np.int64)
    pages = np.zeros(-(-(START + 16) // PAGE), np.int8)  # as the runtime passes them for a verify at START
    result = {"device": torch.cuda.get_device_name(0), "arch": arch, "layers": LAYERS, "read_rows": len(pages) * PAGE,
              "runs": {}}
    ref, t16 = {}, {}
    q16 = rng.standard_normal((LAYERS, 1, 16, HQ, HD)).astype(ml_dtypes.bfloat16)
    for T in ROWS:
        q_h = q16[:, :, :T]
        q = rt.asdevicearray(device, np.ascontiguousarray(q_h))
        exact = _torch_reference(q_h, cache_h, START, len(pages) * PAGE)
        for variant in VARIANTS:
            path = WORK / f"{variant}-t{T}-{arch}.vmfb"
            if not path.is_file():
                continue
            fn = _main_function(path, device)

            def call():
                return np.asarray(fn(q, cache, start, pages)).astype(np.float32)

            out = call()
            ms = []
            for _ in range(30):
                t0 = time.perf_counter()
                call()
                ms.append((time.perf_counter() - t0) * 1e3)
            ref.setdefault(T, out)
            r = {**_kernel_times(call, ms, top=4),
                 "max_abs_diff_vs_first": float(np.abs(out - ref[T]).max()),
                 "max_abs_diff_vs_torch_f32": float(np.abs(out - exact).max())}
            if T == 16:
                t16[variant] = out
            elif variant in t16:
                r["row0_bits_equal_t16"] = bool(np.array_equal(out[:, :, 0], t16[variant][:, :, 0]))
            result["runs"][f"{variant}/T={T}"] = r
            print(f"{variant} T={T}: {r}", flush=True)
    write_json(out_json, result)
    return result


GATED_WORK = common.WORK / "attention-gated"
GATED_LAYERS = 8
# name -> (Hq, Hkv, hd, T): verify blocks of 16 (the demo's of 8) and decode's one token
GATED_SHAPES = {"27b_verify": (24, 4, 256, 16), "27b_decode": (24, 4, 256, 1),
                "9b_verify": (16, 4, 256, 16), "9b_decode": (16, 4, 256, 1),
                "demo_verify": (6, 2, 64, 8), "demo_decode": (6, 2, 64, 1)}
GATED_VARIANTS = ("kernel", "iree")


def gated_layers_module(layers: int = GATED_LAYERS, page: int = PAGE):
    """forward(q [layers, 1, T, Hq, hd] bf16, gate [layers, 1, T, Hq * hd] bf16, cache [1, layers, 2, C,
    Hkv * hd] bf16, start [1] int64, pages [P] int8) -> [layers, 1, T, Hq * hd]: the hybrid target's
    gated attention over every layer (export/qwen35.py `gated_cache_attention`, the named op with its
    gate), reading P * page rows."""
    import torch
    from torch import nn

    from dflash_iree.export.qwen35 import gated_cache_attention

    class Layers(nn.Module):
        def forward(self, q, gate, cache, start, pages):
            read_len = pages.shape[0] * page
            positions = start[:, None] + torch.arange(q.shape[2], dtype=torch.int64)
            return torch.stack([gated_cache_attention(q[layer], gate[layer], cache, layer, read_len, positions, "fused")
                                for layer in range(layers)])

    return Layers()


def prepare_gated(arch: str, shapes=tuple(GATED_SHAPES), variants=GATED_VARIANTS) -> None:
    """One .vmfb per (shape, variant) in GATED_WORK, `gated-{shape}-{variant}-{arch}.vmfb` (module docstring)."""
    import subprocess

    import iree.turbine.aot as aot
    import torch

    from dflash_iree.export.compile import compile_flags, iree_compile_tool, resolve_arch
    from dflash_iree.export.splice import lower_attention, splice_file

    a = resolve_arch(arch)[0]
    GATED_WORK.mkdir(parents=True, exist_ok=True)
    pages = torch.export.Dim("P", min=1, max=CONTEXT // PAGE)
    for shape in shapes:
        Hq, Hkv, hd, T = GATED_SHAPES[shape]
        args = (torch.zeros(GATED_LAYERS, 1, T, Hq, hd, dtype=torch.bfloat16),
                torch.zeros(GATED_LAYERS, 1, T, Hq * hd, dtype=torch.bfloat16),
                torch.zeros(1, GATED_LAYERS, 2, CONTEXT, Hkv * hd, dtype=torch.bfloat16),
                torch.tensor([START]), torch.zeros(18, dtype=torch.int8))
        out = aot.export(gated_layers_module(), args=args,
                         dynamic_shapes={"q": None, "gate": None, "cache": None, "start": None, "pages": {0: pages}})
        mlir = GATED_WORK / f"gated-{shape}.mlir"
        out.save_mlir(mlir)
        for variant in variants:
            # `iree`: a row floor no op reaches leaves every op to IREE (the op's reference operand)
            rule = functools.partial(lower_attention, min_rows=1 if variant == "kernel" else 1 << 30)
            spliced, extra, report = splice_file(mlir, GATED_WORK / f"gated-{shape}-{variant}.mlirbc", a.name,
                                                 {"attention": rule})
            if variant == "kernel" and not report.get("attention", [{}])[0].get("gated"):
                raise SystemExit(f"{shape}: the gated block attention was not placed: {report.get('iree')}")
            vmfb = GATED_WORK / f"gated-{shape}-{variant}-{a.name}.vmfb"
            proc = subprocess.run([iree_compile_tool(), str(spliced), *compile_flags(a), *extra, "-o", str(vmfb)],
                                  capture_output=True, text=True)
            spliced.unlink()
            status = "ok" if proc.returncode == 0 else "failed: " + proc.stderr.strip().splitlines()[-1][:200]
            print(f"{shape} {variant}: {status}", flush=True)
        mlir.unlink()


def _main_function(path, device):
    """The `main` function of the compiled module at PATH, loaded on DEVICE (iree.runtime)."""
    import iree.runtime as rt

    instance = rt.VmInstance()
    vm = rt.VmModule.mmap(instance, str(path))
    ctx = rt.VmContext(instance, modules=[rt.create_hal_module(instance, device), vm])
    return rt.FunctionInvoker(ctx, device, vm.lookup_function("main"))


def _kernel_times(call, ms: list, top: int) -> dict:
    """The median of the wall times MS (ms a call), and from CUPTI over 10 calls of CALL the busy ms
    and kernels a call (device-to-device copies left out) and the TOP kernels by time."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(10):
            call()
    ev = [e for e in prof.key_averages() if e.device_time_total > 0 and "Memcpy" not in e.key]
    return {"wall_ms": round(statistics.median(ms), 4),
            "busy_ms": round(sum(e.device_time_total for e in ev) / 10 / 1e3, 4),
            "kernels_per_call": round(sum(e.count for e in ev) / 10, 1),
            "top": sorted(((e.key[:120], round(e.device_time_total / 10 / 1e3, 4)) for e in ev),
                          key=lambda x: -x[1])[:top]}


def _head_major(x, Hkv: int, hd: int):
    """[..., T, Hq * hd] or [..., T, Hq, hd] of one layer [1, T, ...] -> [1, Hkv, T * g, hd] (the kernel's rows)."""
    T = x.shape[1]
    return x.reshape(1, T, Hkv, -1, hd).transpose(0, 2, 1, 3, 4).reshape(1, Hkv, -1, hd)


def _gated_reference(q, gate, cache, Hkv: int, hd: int, n: int):
    """The float64 attention (head-major [layers, 1, Hkv, R, hd]) and the whole gated rule (float32 bf16
    values, the model's layout [layers, 1, T, Hq * hd]) of kernels/attention/reference.py for every layer."""
    import numpy as np

    from dflash_iree.kernels.attention.reference import attention, gate_output

    L, _, T, Hq, _ = q.shape
    g = Hq // Hkv
    visible = np.arange(n)[None, :] <= (START + np.arange(T))[:, None]  # [T, n]
    mask = np.repeat(visible, g, axis=0)[None, None]  # row t * g + j sees what token t sees
    o = np.stack([attention(_head_major(np.asarray(q[layer], np.float32), Hkv, hd),
                            np.asarray(cache[:, layer:layer + 1], np.float32), mask, 0) for layer in range(L)])
    gh = np.stack([_head_major(np.asarray(gate[layer], np.float32), Hkv, hd) for layer in range(L)])
    full = gate_output(o, gh)  # [L, 1, Hkv, T * g, hd]
    return o, full.reshape(L, 1, Hkv, T, g, hd).transpose(0, 1, 3, 2, 4, 5).reshape(L, 1, T, Hq * hd)


def run_gated(out_json: str, arch: str) -> dict:
    """Runs what prepare_gated compiled for ARCH on the GPU (module docstring); writes and returns the results."""
    import iree.runtime as rt
    import ml_dtypes
    import numpy as np
    import torch

    from dflash_iree.kernels.attention.reference import bits
    from dflash_iree.kernels.gemm.reference import ulp_distance

    device = rt.get_device("cuda")
    bf16 = ml_dtypes.bfloat16
    start = np.array([START], np.int64)
    pages = np.zeros(-(-(START + 16) // PAGE), np.int8)
    n = len(pages) * PAGE
    result = {"device": torch.cuda.get_device_name(0), "arch": arch, "layers": GATED_LAYERS, "read_rows": n,
              "start": START, "runs": {}}
    verify_out = {}

    def diff(a, b) -> dict:
        d = ulp_distance(bits(a), bits(b))
        return {"elements_differ": int((d != 0).sum()), "of": int(d.size), "max_ulps": int(d.max()),
                "max_abs_diff": float(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64)).max())}

    for shape, (Hq, Hkv, hd, T) in GATED_SHAPES.items():
        model = shape.split("_")[0]
        rng = np.random.default_rng(sum(map(ord, model)))  # one draw per model: decode gets verify's token 0
        cache_h = (rng.standard_normal((1, GATED_LAYERS, 2, CONTEXT, Hkv * hd)) * 0.5).astype(bf16)
        q_h = rng.standard_normal((GATED_LAYERS, 1, 16, Hq, hd)).astype(bf16)[:, :, :T]  # decode: verify's token 0
        gate_h = (rng.standard_normal((GATED_LAYERS, 1, 16, Hq * hd)) * 3).astype(bf16)[:, :, :T]
        q_h, gate_h = np.ascontiguousarray(q_h), np.ascontiguousarray(gate_h)
        cache = rt.asdevicearray(device, cache_h)
        q = rt.asdevicearray(device, q_h)
        gates = {"gate": rt.asdevicearray(device, gate_h),
                 "open": rt.asdevicearray(device, np.full(gate_h.shape, 64, bf16))}  # sigmoid(64) rounds to 1
        o_ref, full_ref = _gated_reference(q_h, gate_h, cache_h, Hkv, hd, n)
        outs = {}
        for variant in GATED_VARIANTS:
            path = GATED_WORK / f"gated-{shape}-{variant}-{arch}.vmfb"
            if not path.is_file():
                continue
            fn = _main_function(path, device)

            def call(gate=gates["gate"]):
                return np.asarray(fn(q, gate, cache, start, pages))

            out = call()
            r = _kernel_times(call, common.times(call, 30), top=3)
            outs[variant] = out.astype(np.float32)
            if variant == "kernel":
                from dflash_iree.kernels.attention.reference import gate_output

                o = call(gates["open"]).astype(np.float32)  # bf16(o) in the model's layout
                o_hm = np.stack([_head_major(o[layer], Hkv, hd) for layer in range(GATED_LAYERS)])
                r["gate_rule"] = diff(outs["kernel"], gate_output(o, gate_h.astype(np.float32)))
                r["o_vs_reference"] = diff(o_hm, o_ref.astype(np.float32))
                r["vs_reference"] = diff(outs["kernel"], full_ref)
                if T > 1:
                    verify_out[model] = outs["kernel"]
                elif model in verify_out:
                    r["row0_bits_equal_verify"] = bool(np.array_equal(bits(outs["kernel"][:, :, 0]),
                                                                      bits(verify_out[model][:, :, 0])))
            elif "kernel" in outs:
                r["max_abs_diff_kernel"] = float(np.abs(outs[variant] - outs["kernel"]).max())
            result["runs"][f"{shape}/{variant}"] = r
            print(f"{shape} {variant}: {r}", flush=True)
    write_json(out_json, result)
    return result


def _prepare_options(p) -> None:
    p.add_argument("--arch", default="sm_80")
    p.add_argument("--variants", nargs="+", default=list(VARIANTS))
    p.add_argument("--rows", type=int, nargs="+", default=list(ROWS))


def _run_options(r) -> None:
    r.add_argument("--json", required=True)
    r.add_argument("--arch", default="sm_80")


def _prepare_gated_options(p) -> None:
    p.add_argument("--arch", default="sm_80")
    p.add_argument("--shapes", nargs="+", default=list(GATED_SHAPES), choices=list(GATED_SHAPES))


if __name__ == "__main__":
    sys.exit(main(__doc__, {"prepare": (lambda a: prepare(a.arch, a.variants, a.rows), _prepare_options),
                            "run": (lambda a: run(a.json, a.arch), _run_options),
                            "prepare-gated": (lambda a: prepare_gated(a.arch, a.shapes), _prepare_gated_options),
                            "run-gated": (lambda a: run_gated(a.json, a.arch), _run_options)}))
