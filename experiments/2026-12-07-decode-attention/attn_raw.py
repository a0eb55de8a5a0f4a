"""The block attention at decode's shape on an H100 or H200 (issues #24, #28): variants of
kernels/attention/attention_gpu.cu built with clang defines from HEAD's sources plus attn.patch (which
adds the switches), launched directly through CuPy, timed at the Qwen3-8B shape (8 KV heads, g = 4,
head_dim 128) for decode (T = 1, R = 4) and verify (T = 16, R = 64), their bits checked against the
committed object and decode's row against verify's token 0 at the same position.

    .venv/bin/python experiments/2026-12-07-decode-attention/attn_raw.py build --out .gpu/attn   # here
    python3 experiments/2026-12-07-decode-attention/attn_raw.py run --dir .gpu/attn --json out.json   # there
    ncu ... python3 experiments/2026-12-07-decode-attention/attn_raw.py one --dir .gpu/attn --variant base

Decode's attention took ~15 us a layer in the 8B step's profiles (0.54-0.56 ms a token), IREE's own
~10. Its critical path is a chain of memory round trips; every variant keeps the numerics contract
(attention_body.h) and so the same bits:
- mpre: the mask bytes loaded with q, keys and values, not after the scores (AT_MPRE);
- mlone: the merge loads each chunk's m and l once, not m twice (AT_MLONE);
- mb16: the merge keeps 16 chunks' loads in flight, not 8 (AT_MB);
- minb2: a register cap of 2 workgroups an SM (.minnctapersm, AT_MINB) on top.
Time per layer from a CUDA graph of 36 launches, one per layer of a [1, 36, 2, 4096, 1024] cache.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
VARIANTS = {
    "base2": ["-DAT_MINB=2"],
    "mpre": ["-DAT_MPRE=1"],
    "mlone": ["-DAT_MLONE=1"],
    "mb16": ["-DAT_MB=16"],
    "pm": ["-DAT_MPRE=1", "-DAT_MLONE=1"],
    "all": ["-DAT_MPRE=1", "-DAT_MLONE=1", "-DAT_MB=16"],
    "pm2": ["-DAT_MPRE=1", "-DAT_MLONE=1", "-DAT_MINB=2"],
}
L, C, HKV, G, D = 36, 4096, 8, 4, 128
POSITIONS = (529, 1039, 2063)  # decode N = p + 1; verify N = p + 16


def build(out: Path) -> None:
    """The variants from HEAD's attention sources with attn.patch applied; base = the committed object."""
    sys.path.insert(0, str(ROOT))
    from dflash_iree.kernels.build import CLANG, targets

    _, folder, args = targets()["attention_sm_80.ptx"]
    out = out.resolve()
    out.mkdir(parents=True, exist_ok=True)

    def show(path: str) -> bytes:
        return subprocess.run(["git", "show", f"HEAD:{path}"], cwd=ROOT, check=True, capture_output=True).stdout

    (out / "base.ptx").write_bytes(show("kernels/objects/attention_sm_80.ptx"))
    meta = [{"name": "base", "file": "base.ptx", "defines": []}]
    with tempfile.TemporaryDirectory() as tmp:
        for path in (f"kernels/{folder}/attention_body.h", f"kernels/{folder}/attention_gpu.cu", "kernels/gpu.h"):
            dst = Path(tmp) / path
            dst.parent.mkdir(parents=True, exist_ok=True)
            dst.write_bytes(show(path))
        subprocess.run(["git", "apply", str(Path(__file__).parent / "attn.patch")], cwd=tmp, check=True)
        for name, defs in VARIANTS.items():
            subprocess.run([CLANG, *args, *defs, "-o", str(out / f"{name}.ptx")], cwd=Path(tmp) / "kernels" / folder,
                           check=True)
            meta.append({"name": name, "file": f"{name}.ptx", "defines": defs})
            print(name, flush=True)
    (out / "variants.json").write_text(json.dumps({"variants": meta}, indent=1))


class Harness:
    """Buffers and launches for one device (CuPy over torch's stream)."""

    def __init__(self, d: Path):
        import cupy
        import torch

        self.cupy, self.torch = cupy, torch
        meta = json.loads((d / "variants.json").read_text())
        self.fns = {v["name"]: cupy.RawModule(path=str(d / v["file"])).get_function("dflash_attention")
                    for v in meta["variants"]}
        gen = torch.Generator(device="cuda").manual_seed(0)
        self.cache = torch.randn(1, L, 2, C, HKV * D, generator=gen, device="cuda").to(torch.bfloat16)
        self.q16 = torch.randn(1, 16, HKV * G, D, generator=gen, device="cuda").to(torch.bfloat16)
        self.scale = int.from_bytes(__import__("struct").pack("<f", D ** -0.5 * math.log2(math.e)), "little",
                                    signed=True)

    def inputs(self, T: int, p: int):
        """q [1, T, 32, D], mask int8 [1, T*G, N] (row t*G + j sees keys <= p + t), out, part, cnt."""
        torch = self.torch
        N = p + T
        q = self.q16[:, :T].contiguous()
        R = T * G
        pos = torch.arange(N, device="cuda")
        last = p + torch.arange(T, device="cuda").repeat_interleave(G)
        mask = (pos[None, :] <= last[:, None]).to(torch.int8)[None].contiguous()
        RG = math.ceil(R / 16)
        chunks = math.ceil(N / 64)
        out = torch.empty(1, T, HKV * G * D, dtype=torch.bfloat16, device="cuda")
        part = torch.empty(HKV * RG * chunks * 16 * (D + 2), dtype=torch.float32, device="cuda")
        cnt = torch.zeros(HKV * RG, dtype=torch.int32, device="cuda")
        return dict(q=q, mask=mask, out=out, part=part, cnt=cnt, R=R, N=N, RG=RG, chunks=chunks)

    def launch(self, name: str, b: dict, layer: int) -> None:
        import numpy as np

        cupy = self.cupy
        i32, u64 = np.int32, np.uint64
        st = cupy.cuda.ExternalStream(self.torch.cuda.current_stream().cuda_stream)
        args = (u64(b["q"].data_ptr()), u64(self.cache.data_ptr()), u64(b["mask"].data_ptr()), u64(b["cnt"].data_ptr()),
                u64(b["out"].data_ptr()), u64(b["part"].data_ptr()), i32(b["R"]), i32(b["N"]), i32(D), i32(HKV),
                i32(layer), i32(L), i32(C), i32(b["chunks"]), i32(self.scale), i32(G))
        self.fns[name]((b["chunks"], HKV * b["RG"], 1), (256, 1, 1), args, stream=st)

    def time_layers(self, name: str, b: dict, replays: int = 20) -> float:
        """Microseconds a layer: a CUDA graph of one launch per layer (bench/gemm_bench.py's timer)."""
        sys.path.insert(0, str(ROOT / "bench"))
        from gemm_bench import _time_graph

        def fn():
            for layer in range(L):
                self.launch(name, b, layer)

        return _time_graph(fn, L, replays) * 1e6


def run(d: Path, out_json: Path) -> None:
    import torch

    h = Harness(d)
    names = list(h.fns)
    rec = {"gpu": torch.cuda.get_device_name(0), "shape": {"L": L, "C": C, "Hkv": HKV, "g": G, "D": D},
           "bits": [], "times_us": []}
    for p in POSITIONS:
        for T in (1, 16):
            b = h.inputs(T, p)
            outs = {}
            for n in names:
                b["out"].zero_()
                h.launch(n, b, 7)
                torch.cuda.synchronize()
                outs[n] = b["out"].clone()
            for n in names[1:]:
                rec["bits"].append({"variant": n, "T": T, "p": p,
                                    "differ_vs_base": int((outs[n].view(torch.int16) != outs["base"].view(torch.int16)).sum())})
            if T == 1:
                dec = outs
            else:
                for n in names:
                    rec["bits"].append({"variant": n, "T": "1 vs 16", "p": p, "decode_row_vs_verify_token0_differ":
                                        int((dec[n][0, 0].view(torch.int16) != outs[n][0, 0].view(torch.int16)).sum())})
    for rnd in range(3):  # alternated: each round times every variant at every shape
        for p in POSITIONS:
            for T in (1, 16):
                b = h.inputs(T, p)
                for n in names:
                    rec["times_us"].append({"round": rnd, "variant": n, "T": T, "N": b["N"], "us": h.time_layers(n, b)})
    table = {}
    for t in rec["times_us"]:
        table.setdefault((t["T"], t["N"], t["variant"]), []).append(t["us"])
    rec["median_us"] = [{"T": T, "N": N, "variant": v, "us": round(statistics.median(ts), 3)}
                        for (T, N, v), ts in sorted(table.items())]
    print(f"{'T':>3} {'N':>5} " + " ".join(f"{n:>8}" for n in names))
    for (T, N) in sorted({(T, N) for T, N, _ in table}):
        print(f"{T:>3} {N:>5} " + " ".join(f"{statistics.median(table[(T, N, n)]):8.2f}" for n in names))
    bad = [x for x in rec["bits"] if x.get("differ_vs_base") or x.get("decode_row_vs_verify_token0_differ")]
    print("bits checks", len(rec["bits"]), "failing", len(bad), bad[:6])
    out_json.write_text(json.dumps(rec, indent=1))


def one(d: Path, variant: str, T: int, p: int) -> None:
    """Three launches of VARIANT at (T, p), for Nsight Compute to profile the third."""
    import torch

    h = Harness(d)
    b = h.inputs(T, p)
    for _ in range(3):
        h.launch(variant, b, 7)
    torch.cuda.synchronize()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build")
    b.add_argument("--out", type=Path, default=ROOT / ".gpu" / "attn")
    r = sub.add_parser("run")
    r.add_argument("--dir", type=Path, default=Path(".gpu/attn"))
    r.add_argument("--json", type=Path, required=True)
    o = sub.add_parser("one")
    o.add_argument("--dir", type=Path, default=Path(".gpu/attn"))
    o.add_argument("--variant", default="base")
    o.add_argument("--T", type=int, default=1)
    o.add_argument("--p", type=int, default=529)
    a = ap.parse_args()
    if a.cmd == "build":
        build(a.out)
    elif a.cmd == "run":
        run(a.dir, a.json)
    else:
        one(a.dir, a.variant, a.T, a.p)


if __name__ == "__main__":
    main()
