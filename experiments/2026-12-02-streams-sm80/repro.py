"""Bisect a compile failure: export the tiny pair (tests/tiny.py, in /tmp/s4fix/tiny) with S streams, only the
named entry points (comma list; empty: all), splice for ARCH, run iree-compile with every executable's
source dumped to OUT/src; prints the errors. Usage: repro.py S ARCH OUT [ENTRY,ENTRY]."""
import sys, subprocess, time
from pathlib import Path
import torch
from dflash_iree.export import compile as C, aot
from dflash_iree.export.splice import splice_file
from dflash_iree.arch import resolve_arch, compile_flags
from dflash_iree.export.iree_tool import iree_compile_tool

S = int(sys.argv[1]); arch = sys.argv[2]; out = Path(sys.argv[3]); only = sys.argv[4].split(",") if len(sys.argv) > 4 and sys.argv[4] else None
out.mkdir(parents=True, exist_ok=True)
a, _ = resolve_arch(arch)
p = C.plan("/tmp/s4fix/tiny/target", "/tmp/s4fix/tiny/drafter", max_context=256, streams=S, attention=a.attention)
pair = C._build_pair(p)
with torch.no_grad():
    o, _ = aot.export_module(pair, aot.export_shapes(p), p.sampled, only=only)
o.save_mlir(out / "x.mlirbc")
src, sflags, _ = splice_file(out / "x.mlirbc", out / "s.mlirbc", a.name)
cmd = [iree_compile_tool(), str(src), *compile_flags(a), *sflags, f"--iree-hal-dump-executable-sources-to={out}/src", "-o", str(out / "m.vmfb")]
t = time.time()
r = subprocess.run(cmd, capture_output=True, text=True)
(out / "stderr.txt").write_text(r.stderr)
print("rc", r.returncode, "in", round(time.time() - t), "s")
import re
print("\n".join([l[:300] for l in r.stderr.splitlines() if "error:" in l][:10]))
print(sorted(set(re.findall(r'sym_name = "([^"]*dispatch[^"]*)"', r.stderr))))
