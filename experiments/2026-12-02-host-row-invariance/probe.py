"""Where do the host's decode graph (1 row) and verify graph (B rows) part, bit for bit?

Exports the demo target (bf16, the host's "matmul" attention) with every layer tapped and two debug
functions that return what the production ones keep on the device: `decode_dbg` (one row) and
`verify_dbg` (B rows), each returning the float32 logits and every layer's output. After a prefill
of a prompt, decode at position p and verify rows [p, p+B) see the same cache, so row 0 of verify
must equal decode bit for bit. Prints, per layer, how many elements of that row differ.

    .venv/bin/python experiments/2026-12-02-host-row-invariance/probe.py [--flags ...]
"""
import argparse, json, sys, tempfile, time
from pathlib import Path

import numpy as np
import torch

from dflash_iree.arch import ARCHS
from dflash_iree.checkpoint import index_checkpoint
from dflash_iree.config import load_drafter_config, load_target_config
from dflash_iree.export import aot, entry_points as ep
from dflash_iree.export.dflash import DFlashDrafter
from dflash_iree.export.iree_tool import run_iree_compile
from dflash_iree.export.qwen3 import Qwen3
from dflash_iree.export.splice import splice_file

p = argparse.ArgumentParser()
p.add_argument("--target", default="models/demo/target")
p.add_argument("--drafter", default="models/demo/drafter")
p.add_argument("--flags", nargs="*", default=[])
p.add_argument("--attention", default="matmul")
p.add_argument("--prompt-len", type=int, default=40)
p.add_argument("--out", default=None)
a = p.parse_args()

tcfg = load_target_config(a.target); dcfg = load_drafter_config(a.drafter, tcfg)
L, H, V, B = tcfg.num_hidden_layers, tcfg.hidden_size, tcfg.vocab_size, 8
with torch.device("meta"):
    target = Qwen3(tcfg, 256, tuple(range(L)), 1, torch.bfloat16, attention=a.attention)
    drafter = DFlashDrafter(dcfg, 256, B, 1, torch.bfloat16, attention=a.attention)
pair = aot.Pair(target, drafter).eval(); pair.requires_grad_(False)


def _dbg(m, tokens, start, pages):
    _, logits, taps = m.target(tokens, start, None, read_len=pages.shape[0] * ep.KV_PAGE)
    return logits, taps


def decode_dbg(m, tokens, start, pages):
    return _dbg(m, tokens, start, pages)


def verify_dbg(m, tokens, start, pages):
    return _dbg(m, tokens, start, pages)


T = ep.TensorSpec
shapes = ep.ExportShapes(1, B, 256, "bf16", L * H)
extra = [ep.EntryPoint(n, "target", (T("tokens", (1, t), "i64"), T("start", (1,), "i64"), T("pages", ("P",), "i8")),
                       (T("logits", (1, t, V), "f32"), T("taps", (1, t, L * H), "bf16")), n)
         for n, t in (("decode_dbg", 1), ("verify_dbg", B))]
ep.BODIES.update(decode_dbg=decode_dbg, verify_dbg=verify_dbg)
orig = aot.entry_points
aot.entry_points = lambda s, sampled=True: [e for e in orig(s, False) if e.name == "prefill"] + extra
work = Path(tempfile.mkdtemp())
out, _ = aot.export_module(pair, shapes, sampled=False)
out.save_mlir(work / "m.mlir")
src, sflags, _ = splice_file(work / "m.mlir", work / "s.mlirbc", "host")
t0 = time.time()
run_iree_compile(src, work / "m.vmfb", list(ARCHS["host"].flags) + a.flags, work / "stats.csv", sflags)
print(f"compiled in {time.time() - t0:.0f}s with {a.flags}", file=sys.stderr)

import iree.runtime as rt
inst = rt.VmInstance(); dev = rt.get_device("local-task")
idx = {}
for scope, folder in (("target", a.target), ("drafter", a.drafter)):
    idx[scope] = rt.ParameterIndex()
    for f in sorted({i.file for i in index_checkpoint(folder).values()}):
        idx[scope].load(str(f))
vm = rt.VmModule.mmap(inst, str(work / "m.vmfb"))
ctx = rt.VmContext(inst, modules=[rt.create_hal_module(inst, dev),
                                  rt.create_io_parameters_module(inst, *[idx[s].create_provider(scope=s) for s in idx]), vm])
fn = {n: rt.FunctionInvoker(ctx, dev, vm.lookup_function(n)) for n in ("prefill", "decode_dbg", "verify_dbg")}
rng = np.random.default_rng(0)
prompt = rng.integers(10, V, a.prompt_len)
pages = np.zeros(-(-(a.prompt_len + B) // ep.KV_PAGE), np.int8)
chosen = np.zeros((1, 1), np.int64)
fn["prefill"](prompt[None], np.array([0]), pages, chosen)
nxt = rng.integers(10, V, B)
s = np.array([a.prompt_len])
lv, tv = (np.asarray(x.to_host()) for x in fn["verify_dbg"](nxt[None], s, pages))
ld, td = (np.asarray(x.to_host()) for x in fn["decode_dbg"](nxt[None, :1], s, pages))
tv, td = tv.view(np.uint16).reshape(B, L, H), td.view(np.uint16).reshape(1, L, H)
row = {f"layer {i}": int((tv[0, i] != td[0, i]).sum()) for i in range(L)}
row["logits"] = int((lv[0, 0] != ld[0, 0]).sum())
f32 = lambda u: (u.astype(np.uint32) << 16).view(np.float32)  # noqa: E731
row["layer 0 max |diff| / max |x|"] = float(np.abs(f32(tv[0, 0]) - f32(td[0, 0])).max() / np.abs(f32(td[0, 0])).max())
row["logits max |diff|"] = float(np.abs(lv[0, 0] - ld[0, 0]).max())
print(json.dumps({"flags": a.flags, "attention": a.attention, "differing elements of row 0": row}))
if a.out:
    Path(a.out).write_text(json.dumps({"flags": a.flags, "attention": a.attention, "differ": row}, indent=1))
