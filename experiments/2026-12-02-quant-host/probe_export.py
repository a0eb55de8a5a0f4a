"""Export one QuantLinear (export/quantized.py, MLX and compressed-tensors) with iree-turbine and
compile it for the host: does the graph legalize, and how many dispatches does it make?"""
import subprocess
import sys
import tempfile

import torch
import iree.turbine.aot as aot

from dflash_iree.quant import CT, MLX, QuantFormat, QuantLayer
from dflash_iree.export.quantized import QuantLinear

M, N, K = (int(a) for a in (sys.argv[1:4] if len(sys.argv) > 3 else (1, 256, 256)))
for method, sym in ((MLX, True), (CT, False)):
    fmt = QuantFormat(method, 4, 64, sym)
    keys = ({"packed": "l.weight", "scales": "l.scales", "biases": "l.biases"} if method == MLX else
            {"packed": "l.weight_packed", "scales": "l.weight_scale", "shape": "l.weight_shape", "zeros": "l.weight_zero_point"})
    lin = QuantLinear(QuantLayer("l", N, K, fmt, keys), {k: torch.float32 for k in keys.values()} | {"l.weight_shape": torch.int64}, torch.float32)
    for p in lin.parameters():
        p.data.zero_()
    out = aot.export(lin, torch.zeros(M, K), strict_export=False)
    with tempfile.TemporaryDirectory() as d:
        out.save_mlir(f"{d}/m.mlir")
        r = subprocess.run([sys.executable, "-m", "iree.compiler.tools.scripts.iree_compile", f"{d}/m.mlir", "-o", f"{d}/m.vmfb",
                            "--iree-hal-target-device=local", "--iree-hal-local-target-device-backends=llvm-cpu",
                            "--iree-llvmcpu-target-cpu=host"], capture_output=True, text=True)
        print(method, "rc", r.returncode, r.stderr[-800:])
