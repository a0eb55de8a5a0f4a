"""Tiny bf16 4-bit pairs (tests/quant_writers.py: MLX group 64, compressed-tensors asymmetric and symmetric
group 32, from one bf16 tiny target; a bf16 tiny drafter) compiled for sm_80: on the GPU, drafted == plain
(greedy and seeded T = 1) per format, and the plain tokens against the eager reference's (host, bf16).

    python experiments/2026-12-03-q4-gpu/tiny_q4.py expect --dir .gpu/q4tiny        # here: writes expected.json
    python3 experiments/2026-12-03-q4-gpu/tiny_q4.py check --dir .gpu/q4tiny --json out.json   # on the GPU

--dir holds float/, drafter/, mlx/, ct/, cts/ (checkpoints) and out-mlx/, out-ct/, out-cts/ (artifacts).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

FORMATS = ("mlx", "ct", "cts")  # those whose out-* folder travelled are checked
PROMPTS = [[5, 17, 301, 42, 7], [100 + i for i in range(40)], [3, 3, 3, 9]]
N_NEW = 40


def expect(d: Path) -> None:
    from dflash_iree.export.load import load_pair
    from dflash_iree.export.reference import generate_plain

    out = {}
    for f in FORMATS:
        target = load_pair(d / f, d / "drafter", 256, "bf16")[0]
        out[f] = [generate_plain(target, p, N_NEW).tokens for p in PROMPTS]
    (d / "expected.json").write_text(json.dumps(out))


def check(d: Path, out_json: Path) -> None:
    from dflash_iree.runtime.engine import Engine
    from dflash_iree.runtime.options import GenerateOptions

    expected = json.loads((d / "expected.json").read_text())
    rec = {}
    for f in [f for f in FORMATS if (d / f"out-{f}").is_dir()]:
        e = Engine.load(d / f"out-{f}", d / f, d / "drafter", "cuda")
        r = {}
        for name, kw in (("greedy", {}), ("t1", {"temperature": 1.0, "seed": 3})):
            plain = [e.generate(p, options=GenerateOptions(max_new_tokens=N_NEW, speculative=False, **kw)).tokens
                     for p in PROMPTS]
            drafted = [e.generate(p, options=GenerateOptions(max_new_tokens=N_NEW, **kw)) for p in PROMPTS]
            r[name] = {"drafted_equals_plain": sum(a == b.tokens for a, b in zip(plain, drafted)),
                       "accepted": sorted({a for g in drafted for a in g.accepted})}
            if name == "greedy":
                r[name]["plain_equals_eager_bf16"] = sum(a == b for a, b in zip(plain, expected[f]))
                r[name]["first_divergence"] = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
                                               for a, b in zip(plain, expected[f])]
        rec[f] = r
        print(f, json.dumps(r), flush=True)
    out_json.write_text(json.dumps({"prompts": len(PROMPTS), "new_tokens": N_NEW, "formats": rec}, indent=1) + "\n")


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("cmd", choices=("expect", "check"))
    ap.add_argument("--dir", type=Path, required=True)
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    expect(a.dir) if a.cmd == "expect" else check(a.dir, a.json)
