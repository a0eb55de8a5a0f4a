"""Decode and verify step times of two host modules of one pair, side by side: the bf16 demo target
and its MLX 4-bit copy (written by mlx-lm `convert`), alternated in one process.

    python experiments/2026-12-02-quant-host/step_times.py prepare     # convert + compile both (slow)
    python experiments/2026-12-02-quant-host/step_times.py run [--rounds 5 --steps 50]

Each step is one synchronous call as the runtime makes it (CompiledPair.decode / verify, the chosen
tokens read back) at a fixed position after a 128-token prefill (rollback by length: the same KV
rows are rewritten). Prints a table and writes results.json beside this file.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
WORK = ROOT / "build" / "quant-host"  # git-ignored
TARGET, DRAFTER = ROOT / "models" / "demo" / "target", ROOT / "models" / "demo" / "drafter"
MLX = WORK / "target-mlx4"
RESULTS = "results.json"
ARMS = {"float": (TARGET, WORK / "host-bf16"), "mlx4": (MLX, WORK / "host-mlx4")}


def prepare() -> None:
    from mlx_lm import convert

    from dflash_iree.export.compile import compile_artifacts

    WORK.mkdir(parents=True, exist_ok=True)
    if not MLX.exists():
        convert(str(TARGET), mlx_path=str(MLX), quantize=True, q_group_size=64, q_bits=4)
        for name in ("tokenizer.json", "tokenizer_config.json"):
            (MLX / name).write_bytes((TARGET / name).read_bytes())
    for name, (target, out) in ARMS.items():
        if not (out / "manifest.json").exists():
            compile_artifacts("host", target, DRAFTER, out, max_context=512)


def _time(fn, steps: int) -> float:
    t0 = time.perf_counter()
    for _ in range(steps):
        fn()
    return (time.perf_counter() - t0) / steps * 1e3


def run(rounds: int, steps: int) -> None:
    from dflash_iree.runtime.engine import Engine

    engines = {name: Engine.load(out) for name, (_, out) in ARMS.items()}
    prompt = [(7 * i + 3) % 8000 + 1 for i in range(128)]
    times = {name: {"decode": [], "verify": []} for name in engines}
    for name, e in engines.items():
        e.module.prefill(prompt)
    for _ in range(rounds):  # A B A B: the machine's load drifts alike for both
        for name, e in engines.items():
            pair, B = e.module, e.block_size
            times[name]["decode"].append(_time(lambda: pair.decode(5, len(prompt)), steps))
            times[name]["verify"].append(_time(lambda: pair.verify([5] * B, len(prompt)), steps))
    weights = {}
    for name, (target, out) in ARMS.items():
        m = json.loads((out / "manifest.json").read_text())
        q = m["target"].get("quantization")
        weights[name] = q["bytes"] if q else {"float": sum(
            (2 if v["dtype"] == "bf16" else 4) * __import__("math").prod(v["shape"]) for v in m["parameters"]["target"].values())}
        weights[name]["dispatches"] = m["stats"].get("dispatches")
    result = {name: {k: {"median_ms": statistics.median(v), "all_ms": v} for k, v in t.items()} | {"target": weights[name]}
              for name, t in times.items()}
    result["rounds"], result["steps"] = rounds, steps
    (HERE / RESULTS).write_text(json.dumps(result, indent=1) + "\n")
    print(f"| module | decode ms | verify({engines['float'].block_size}) ms | verify/decode | target bytes | dispatches |")
    print("|---|---|---|---|---|---|")
    for name in engines:
        d, v = result[name]["decode"]["median_ms"], result[name]["verify"]["median_ms"]
        b = sum(x for k, x in weights[name].items() if k != "dispatches")
        print(f"| {name} | {d:.3f} | {v:.3f} | {v / d:.2f} | {b / 2**20:.1f} MiB | {weights[name]['dispatches']} |")
    r = {k: result["mlx4"][k]["median_ms"] / result["float"][k]["median_ms"] for k in ("decode", "verify")}
    print(f"mlx4 / float: decode {r['decode']:.2f}x, verify {r['verify']:.2f}x the time")


if __name__ == "__main__":
    args = sys.argv[1:]
    if "--arms" in args:  # --arms FLOAT_DIR MLX4_DIR: two compiled folders of one shape, in place of the demo's
        i = args.index("--arms")
        ARMS.update({"float": (None, Path(args[i + 1])), "mlx4": (None, Path(args[i + 2]))})
        del args[i:i + 3]
        RESULTS = "results_tiny.json"
    if args[:1] == ["prepare"]:
        prepare()
    else:
        kw = dict(zip(args[1::2], args[2::2]))
        run(int(kw.get("--rounds", 5)), int(kw.get("--steps", 50)))
