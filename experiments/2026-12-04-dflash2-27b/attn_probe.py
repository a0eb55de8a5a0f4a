"""Probe: the 27B DFlash2 example's drafter attention alone on the H200, in the forms it could take.

The draft step's profile (draft_step_27b.json) puts 6.19 of its 9.82 ms in five IREE attention
dispatches `attention_8x8x4x128x128x2065`: 8 block rows x 4 query heads a KV head over the ring's
2057 context slots + the 8 block rows, 1.24 ms a layer, where the 8B drafter's (a dynamic ~540
keys) takes 0.07 ms. Each module here is one layer of export/dflash.py's attention shape
(q [1, 8, 32, 128], k, v [1, N, 8, 128] bf16, visible [1, 8, N] bool) through:

- `attend_2065`: export/qwen3.py `attend` at N = 2065 static (what the draft step runs now);
- `attend_2112`: the same with the keys padded to 2112 (a multiple of 64), the pad masked out;
- `attend_dyn`: N dynamic (2065 at run time), as the 8B drafter's context is;
- `matmul_2065`: export/qwen3.py `attend_matmul` at N = 2065.

    python attn_probe.py prepare        # here: .gpu/attn_probe/*.vmfb (sm_80)
    python attn_probe.py run OUT.json   # on the H200 (bench/on_device.sh)
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
WORK = ROOT / ".gpu" / "attn_probe"
T, HQ, HKV, HD, N = 8, 32, 8, 128, 2065
VARIANTS = {"attend_2065": ("attend", 2065, False), "attend_2112": ("attend", 2112, False),
            "attend_dyn": ("attend", 2065, True), "matmul_2065": ("matmul", 2065, False)}


def _module(form: str):
    import torch

    from dflash_iree.export.qwen3 import attend, attend_matmul

    fn = attend if form == "attend" else attend_matmul

    class One(torch.nn.Module):
        def forward(self, q, k, v, visible):
            return fn(q, k, v, visible != 0)  # int8 in: the first run, with a bool argument, hung

    return One()


def prepare() -> None:
    import subprocess

    import iree.turbine.aot as aot
    import torch

    from dflash_iree.export.compile import compile_flags, iree_compile_tool, resolve_arch

    a = resolve_arch("sm_80")[0]
    WORK.mkdir(parents=True, exist_ok=True)
    for name, (form, n, dyn) in VARIANTS.items():
        args = (torch.zeros(1, T, HQ, HD, dtype=torch.bfloat16), torch.zeros(1, n, HKV, HD, dtype=torch.bfloat16),
                torch.zeros(1, n, HKV, HD, dtype=torch.bfloat16), torch.ones(1, T, n, dtype=torch.int8))
        shapes = None
        if dyn:
            d = torch.export.Dim("N", min=16, max=4096)
            shapes = {"q": None, "k": {1: d}, "v": {1: d}, "visible": {2: d}}
        out = aot.export(_module(form), args=args, dynamic_shapes=shapes)
        mlir = WORK / f"{name}.mlir"
        out.save_mlir(mlir)
        t0 = time.perf_counter()
        p = subprocess.run([iree_compile_tool(), str(mlir), *compile_flags(a), "-o", str(WORK / f"{name}.vmfb")],
                           capture_output=True, text=True)
        print(name, "ok" if p.returncode == 0 else p.stderr[-400:], f"{time.perf_counter() - t0:.0f}s", flush=True)


def run(out_json: str) -> None:
    import iree.runtime as rt
    import ml_dtypes
    import numpy as np
    import torch
    from torch.profiler import ProfilerActivity, profile

    device = rt.get_device("cuda")
    rng = np.random.default_rng(0)
    q = rng.standard_normal((1, T, HQ, HD)).astype(ml_dtypes.bfloat16)
    k = rng.standard_normal((1, 2112, HKV, HD)).astype(ml_dtypes.bfloat16)
    v = rng.standard_normal((1, 2112, HKV, HD)).astype(ml_dtypes.bfloat16)
    vis = np.zeros((1, T, 2112), np.int8)
    vis[:, :, :2057] = rng.random((1, T, 2057)) < 0.95  # the ring's slots, most held
    vis[:, :, 2057:2065] = np.tril(np.ones((T, T), np.int8))[None]  # the block, causal (sliding layers)
    result = {"device": torch.cuda.get_device_name(0), "runs": {}}
    first = None
    for name, (form, n, dyn) in VARIANTS.items():
        path = WORK / f"{name}.vmfb"
        if not path.is_file():
            continue
        print(name, "loading", flush=True)
        inst = rt.VmInstance()
        vm = rt.VmModule.mmap(inst, str(path))
        ctx = rt.VmContext(inst, modules=[rt.create_hal_module(inst, device), vm])
        fn = rt.FunctionInvoker(ctx, device, vm.lookup_function("main"))
        args = [rt.asdevicearray(device, np.ascontiguousarray(x)) for x in
                (q, k[:, :n], v[:, :n], vis[:, :, :n])]

        def call():
            return np.asarray(fn(*args)).astype(np.float32)

        out = call()
        first = out if first is None else first
        ms = []
        for _ in range(30):
            t0 = time.perf_counter()
            call()
            ms.append((time.perf_counter() - t0) * 1e3)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(10):
                call()
        ev = [e for e in prof.key_averages() if e.device_time_total > 0 and "Memcpy" not in e.key]
        r = {"wall_ms": round(statistics.median(ms), 4),
             "busy_ms": round(sum(e.device_time_total for e in ev) / 10 / 1e3, 4),
             "kernels": [(e.key[:90], round(e.device_time_total / 10 / 1e3, 4)) for e in ev],
             "max_abs_diff_vs_first": float(np.abs(out - first).max())}
        result["runs"][name] = r
        print(name, r, flush=True)
    Path(out_json).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    prepare() if sys.argv[1] == "prepare" else run(sys.argv[2])
