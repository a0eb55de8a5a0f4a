"""The S = 1 export's MLIR bytes (every entry point; export/dflash.py's `draft_block` refactor must not
change them): prints the sha256. Run on this tree and on the commit before, compare.

    .venv/bin/python experiments/2026-12-02-one-stream/s1_same.py /tmp/one/tiny OUT.mlirbc [matmul|fused] [old]
"""
import hashlib
import sys

import torch

from dflash_iree.export import aot
from dflash_iree.export import compile as C

tiny, out = sys.argv[1], sys.argv[2]
if len(sys.argv) > 4 and sys.argv[4] == "old":  # the drafter's forward of the commit before draft_block
    import subprocess

    import dflash_iree.export.dflash as D
    new_cls = D.DFlashDrafter
    src = subprocess.run(["git", "show", "0cd10b4:export/dflash.py"], capture_output=True, text=True, check=True).stdout
    exec(compile(src, D.__file__, "exec"), D.__dict__)
    new_cls.forward = D.DFlashDrafter.forward
    D.DFlashDrafter = new_cls
attention = sys.argv[3] if len(sys.argv) > 3 else "matmul"  # host: matmul; GPU archs: fused
p = C.plan(f"{tiny}/target", f"{tiny}/drafter", max_context=256, streams=1, attention=attention)
with torch.no_grad():
    o, _ = aot.export_module(C._build_pair(p), aot.export_shapes(p), p.sampled)
o.save_mlir(out)
print("S=1", attention, hashlib.sha256(open(out, "rb").read()).hexdigest())
