"""S = 1 export of prefill, verify, absorb with this tree's cache_rows and with main's: the same MLIR bytes."""
import hashlib, torch, types
from dflash_iree.export import compile as C, aot, qwen3, dflash
ns = {}
src = __import__("subprocess").run(["git", "show", "main:export/qwen3.py"], capture_output=True, text=True).stdout
start = src.index("def cache_rows"); end = src.index("def write_cache")
exec("import torch\n" + src[start:end], ns)
def export(tag):
    p = C.plan("/tmp/s4fix/tiny/target", "/tmp/s4fix/tiny/drafter", max_context=256, streams=1)
    with torch.no_grad():
        o, _ = aot.export_module(C._build_pair(p), aot.export_shapes(p), p.sampled, only=["prefill", "absorb", "verify"])
    o.save_mlir(f"/tmp/s4fix/s1-{tag}.mlirbc")
    return hashlib.sha256(open(f"/tmp/s4fix/s1-{tag}.mlirbc", "rb").read()).hexdigest()
new = export("new")
qwen3.cache_rows = dflash.cache_rows = ns["cache_rows"]
old = export("old")
print("S=1 MLIR identical:", new == old, new[:12], old[:12])
