"""As it ran: the decode and verify logits at prompt 5's first divergence (token 17), through tests/test_row_invariance.py's
debug module: bit-equal, top two 1338 (10.619734) and 429 (10.596333), both 10.625 in bf16."""
import json, sys, numpy as np
sys.path.insert(0, "tests")
from pathlib import Path
import test_row_invariance as T
from dflash_iree.arch import ARCHS
Path("/tmp/dbg").mkdir(exist_ok=True)
src, L, H, V = T.export_debug(Path("/tmp/dbg"))
d = json.load(open("/tmp/div5.json"))
k = 17
full = d["prompt"] + d["exact"]
pos = len(d["prompt"]) + k - 1  # the token at index k of the output is chosen after position pos
# prefill up to pos (exclusive), then decode/verify the token at pos
pre, blk = full[:pos], full[pos:pos + T.B]
r = T._rows(src, list(ARCHS["host"].flags), L, H, V, prompt=pre, block=blk)
lv = r["verify logits"][0].view(np.float32); ld = r["decode logits"][0].view(np.float32)
top = np.argsort(-ld)[:3]
print("equal logits:", bool((r["verify logits"][0] == r["decode logits"][0]).all()), "top3", top, ld[top], "low bits", (r["decode logits"][0][top] & 0xFFFF))
print("exact chose", d["exact"][k], "plain chose", d["plain"][k])
