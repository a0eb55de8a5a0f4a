"""One linear y = x . W^T on the host (llvm-cpu, IREE 3.13): the 4-bit MLX form of export/quantized.py
(packed uint32 words, bf16 scales and biases, group 64, dequantized in the graph) against bf16,
weights as external parameters as in the real module. Reports hoisted load-time globals (a
dequantized copy made at load would be one), dispatches, and the time per call at M rows.

    python experiments/2026-12-02-quant-host/probe_linear.py [N K]
"""
import json
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import iree.runtime as rt
import iree.turbine.aot as aot
from torch import nn

from dflash_iree.quant import MLX, QuantFormat, QuantLayer
from dflash_iree.export.quantized import QuantLinear

N, K = (int(a) for a in (sys.argv[1:3] if len(sys.argv) > 2 else (2048, 2048)))
FLAGS = ["--iree-hal-target-device=local", "--iree-hal-local-target-device-backends=llvm-cpu",
         "--iree-llvmcpu-target-cpu=host"]


class Wrap(nn.Module):
    def __init__(self, lin):
        super().__init__()
        self.lin = lin

    def forward(self, x):
        return self.lin(x)


def build(form):
    if form == "bf16":
        return Wrap(nn.Linear(K, N, bias=False, dtype=torch.bfloat16))
    keys = {"packed": "lin.weight", "scales": "lin.scales", "biases": "lin.biases"}
    q = QuantLinear(QuantLayer("lin", N, K, QuantFormat(MLX, 4, 64), keys),
                    {"lin.scales": torch.bfloat16, "lin.biases": torch.bfloat16}, torch.bfloat16)
    rng = np.random.default_rng(0)
    q.weight.data = torch.from_numpy(rng.integers(-2**31, 2**31 - 1, (N, K // 8), dtype=np.int64).astype(np.int32))
    q.scales.data = torch.full((N, K // 64), 0.01, dtype=torch.bfloat16)
    q.biases.data = torch.full((N, K // 64), -0.08, dtype=torch.bfloat16)
    return Wrap(q)


def main():
    rows = {}
    for form in ("bf16", "mlx4"):
        model = build(form)
        aot.externalize_module_parameters(model)
        for M in (1, 16):
            with tempfile.TemporaryDirectory() as d:
                out = aot.export(model, torch.zeros(M, K, dtype=torch.bfloat16), strict_export=False)
                out.save_mlir(f"{d}/m.mlir")
                subprocess.run(["iree-compile", f"{d}/m.mlir", "-o", f"{d}/m.vmfb", *FLAGS,
                                f"--dump-compilation-phases-to={d}/ph"], check=True, capture_output=True)
                ir = next(Path(f"{d}/ph").glob("*.global-optimization.mlir")).read_text()
                hoisted = re.findall(r"util\.global private (?:mutable )?@(__hoisted\S*) .*?: tensor<([^>]*)>", ir)
                disp = len(re.findall(r"flow\.dispatch @", next(Path(f"{d}/ph").glob("*.flow.mlir")).read_text()))
                idx = rt.ParameterIndex()
                for name, p in model.named_parameters():
                    arr = p.detach().view(torch.int16).numpy() if p.dtype == torch.bfloat16 else p.detach().numpy()
                    idx.add_buffer(name, arr.tobytes())
                inst = rt.VmInstance()
                dev = rt.get_device("local-task")
                mod = rt.VmModule.mmap(inst, f"{d}/m.vmfb")
                ctx = rt.VmContext(inst, [rt.create_hal_module(inst, dev),
                                          rt.create_io_parameters_module(inst, idx.create_provider(scope="model")), mod])
                f = rt.FunctionInvoker(ctx, dev, mod.lookup_function("main"))
                import ml_dtypes
                xa = np.zeros((M, K), ml_dtypes.bfloat16)
                for _ in range(5):
                    f(xa)
                n = 200
                t0 = time.perf_counter()
                for _ in range(n):
                    np.asarray(f(xa))
                ms = (time.perf_counter() - t0) / n * 1e3
            rows[f"{form} M={M}"] = {"ms": ms, "dispatches": disp, "hoisted": hoisted}
            print(form, M, f"{ms:.4f} ms", disp, "dispatches", "hoisted:", hoisted, flush=True)
    Path(__file__).with_name(f"probe_linear_{N}x{K}.json").write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
