"""Is a bf16 matmul row the same at M=1 and M=8 on the host (llvm-cpu)? usage: linear_probe.py K N [iree flags]"""
import sys, numpy as np, torch, iree.turbine.aot as aot, iree.compiler as ic, iree.runtime as rt
from dflash_iree.arch import ARCHS
torch.manual_seed(0)
K, N = int(sys.argv[1]), int(sys.argv[2]); extra = sys.argv[3:]
class M(torch.nn.Module):
    def forward(s, w, x1, x8):
        w = w.to(torch.bfloat16)
        return (x1.to(torch.bfloat16) @ w.T).float(), (x8.to(torch.bfloat16) @ w.T).float()
x8 = torch.randn(1, 8, K).to(torch.bfloat16).float(); x1 = x8[:, 2:3].clone()
m = M(); w = torch.randn(N, K).to(torch.bfloat16).float()
e = aot.export(m, args=(w, x1, x8))
vm = ic.compile_str(str(e.mlir_module), extra_args=list(ARCHS["host"].flags) + extra)
inst = rt.VmInstance(); dev = rt.get_device("local-task")
cfg = rt.Config(device=dev); ctx = rt.SystemContext(config=cfg)
ctx.add_vm_module(rt.VmModule.copy_buffer(ctx.instance, vm))
f = ctx.modules.module["main"]
o1, o8 = f(w.numpy(), x1.numpy(), x8.numpy())
o1, o8 = np.asarray(o1.to_host()), np.asarray(o8.to_host())
ref = m(w, x1, x8)
print("flags", extra, "rows differ:", int((o1[0, 0] != o8[0, 2]).sum()), "of", N,
      "| vs torch M=1:", int((o1[0,0] != ref[0][0,0].numpy()).sum()), "M=8:", int((o8[0,2] != ref[1][0,2].numpy()).sum()))
