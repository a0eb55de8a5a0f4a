"""The host (llvm-cpu, local-task): one row's argmax in one level against export/sampling.py's two
levels, alternated 7 times in one process, 200 calls each, us a call (the run in README.md).

    .venv/bin/python experiments/2026-12-07-argmax/host_ab.py
"""
import sys, subprocess, tempfile, time, numpy as np, torch
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from dflash_iree.arch import compile_flags, resolve_arch
from dflash_iree.export.iree_tool import iree_compile_tool
from dflash_iree.export.sampling import _argmax_flat, argmax
from iree.turbine import aot
import iree.runtime as rt
V=151936
class C(torch.nn.Module):
    def __init__(s, fn): super().__init__(); s.fn=fn
    def forward(s, x): return s.fn(x.float())
tmp=Path(tempfile.mkdtemp()); fs={}
cfg=rt.Config("local-task")
for name, fn in (("flat", _argmax_flat), ("two", argmax)):
    aot.export(C(fn), args=(torch.zeros(1,1,V),)).save_mlir(tmp/"m.mlir")
    subprocess.run([iree_compile_tool(), str(tmp/"m.mlir"), "-o", str(tmp/f"{name}.vmfb"), *compile_flags(resolve_arch("host")[0])], check=True)
    ctx=rt.SystemContext(config=cfg); ctx.add_vm_module(rt.VmModule.mmap(cfg.vm_instance, str(tmp/f"{name}.vmfb")))
    fs[name]=ctx.modules.module["main"]
x=np.random.default_rng(0).standard_normal((1,1,V)).astype(np.float32)
res={k:[] for k in fs}
for r in range(7):
    for k,f in fs.items():
        for _ in range(20): f(x)
        t=time.perf_counter()
        for _ in range(200): np.asarray(f(x))
        res[k].append((time.perf_counter()-t)/200*1e6)
for k,v in res.items(): print(k, [round(a) for a in v], "median", round(sorted(v)[3]))
