"""Which op of a Qwen3 layer rounds differently at 1 row and at 8 rows on the host (llvm-cpu)?

Each probe exports one piece of export/qwen3.py at the demo target's shapes (bf16), called on 1 row
and on 8 rows in one function, compiles it for the host and counts the elements of the 8-row call's
row 2 that differ from the 1-row call (bit for bit), and from eager torch.

    .venv/bin/python experiments/2026-12-03-host-row-ops/op_probe.py [--json F] [iree flags...]
"""
import argparse, json, sys
import numpy as np, torch, iree.turbine.aot as aot, iree.compiler as ic, iree.runtime as rt
import torch.nn.functional as F
from dflash_iree.arch import ARCHS
from dflash_iree.export.qwen3 import apply_rope, attend_matmul, rms_norm

ap = argparse.ArgumentParser()
ap.add_argument("--json")
ap.add_argument("--only", default="", help="run the probes whose name contains this")
ap.add_argument("--ctx", type=int, default=48, help="keys read (the cache rows of attention)")
a, flags = ap.parse_known_args()
torch.manual_seed(0)
H, I, Hq, Hkv, hd, N = 384, 1024, 6, 2, 64, a.ctx
bf = lambda *s: torch.randn(*s).to(torch.bfloat16)  # noqa: E731
W = dict(norm=bf(H) * 0.1 + 1, o=bf(H, Hq * hd) * 0.05, g=bf(I, H) * 0.05, u=bf(I, H) * 0.05, d=bf(H, I) * 0.03,
         qn=bf(hd) * 0.1 + 1, k=bf(1, N, Hkv, hd), v=bf(1, N, Hkv, hd))
W = {k: v.float() for k, v in W.items()}  # module constants in float32 (the exporter keeps no bf16 global)
w = lambda name: W[name].to(torch.bfloat16)  # noqa: E731
P = 40  # the row's position: keys 0..P visible to it


def rope(t, first):
    pos = torch.arange(t)[None] + first
    inv = 1.0 / (10000.0 ** (torch.arange(0, hd, 2).float() / hd))
    e = torch.cat([pos[..., None].float() * inv] * 2, -1)
    return e.cos().to(torch.bfloat16), e.sin().to(torch.bfloat16)


def visible(t, first):
    return torch.arange(N)[None, None, :] <= (torch.arange(t)[None, :, None] + first)


PROBES = {  # name -> (fn(x [1, t, ...], position of row 0), input shape at t rows)
    "rms_norm": (lambda x, p: rms_norm(x, w("norm"), 1e-6), (H,)),
    "linear o_proj + residual": (lambda x, p: x[..., :H] + F.linear(x, w("o")), (Hq * hd,)),
    "linear o_proj": (lambda x, p: F.linear(x, w("o")), (Hq * hd,)),
    "swiglu (gate, up)": (lambda x, p: F.silu(F.linear(x, w("g"))) * F.linear(x, w("u")), (H,)),
    "down_proj + residual": (lambda x, p: x[..., :H] + F.linear(x, w("d")), (I,)),
    "q_norm + rope": (lambda x, p: apply_rope(rms_norm(x, w("qn"), 1e-6), *rope(x.shape[1], p)), (Hq, hd)),
    "rms_norm -> swiglu": (lambda x, p: F.silu(F.linear(rms_norm(x, w("norm"), 1e-6), w("g")))
                          * F.linear(rms_norm(x, w("norm"), 1e-6), w("u")), (H,)),
    "rms_norm -> linear": (lambda x, p: F.linear(rms_norm(x, w("norm"), 1e-6), w("g")), (H,)),
    "swiglu -> down + residual": (lambda x, p: x + F.linear(F.silu(F.linear(x, w("g"))) * F.linear(x, w("u")), w("d")),
                                  (H,)),
    "MLP half (norm, swiglu, down, residual)": (lambda x, p: x + F.linear(
        F.silu(F.linear(rms_norm(x, w("norm"), 1e-6), w("g"))) * F.linear(rms_norm(x, w("norm"), 1e-6), w("u")),
        w("d")), (H,)),
    "attention (matmul form)": (lambda x, p: attend_matmul(x, w("k"), w("v"), visible(x.shape[1], p)), (Hq, hd)),
}


class Probe(torch.nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, x1, x8):  # float32 in (bf16 values), so numpy can pass them
        # x1 is row 2 of x8, so at position P + 2
        return self.fn(x1.to(torch.bfloat16), P + 2).float(), self.fn(x8.to(torch.bfloat16), P).float()


results = {}
for name, (fn, shape) in PROBES.items():
    if a.only not in name:
        continue
    x8 = bf(1, 8, *shape).float()
    x1 = x8[:, 2:3].clone()
    m = Probe(fn)
    vm = ic.compile_str(str(aot.export(m, args=(x1, x8)).mlir_module), extra_args=list(ARCHS["host"].flags) + flags)
    ctx = rt.SystemContext(config=rt.Config(device=rt.get_device("local-task")))
    ctx.add_vm_module(rt.VmModule.copy_buffer(ctx.instance, vm))
    o1, o8 = (np.asarray(o.to_host()) for o in ctx.modules.module["main"](x1.numpy(), x8.numpy()))
    e1, e8 = (t.numpy() for t in m(x1, x8))
    r = {"rows differ": int((o1[0, 0] != o8[0, 2]).sum()), "of": int(o1[0, 0].size),
         "1 row vs eager": int((o1[0, 0] != e1[0, 0]).sum()), "8 rows vs eager": int((o8[0, 2] != e8[0, 2]).sum())}
    results[name] = r
    print(f"{name:28s} {r}", flush=True)
if a.json:
    open(a.json, "w").write(json.dumps({"flags": flags, "ctx": N, "probes": results}, indent=1) + "\n")
