"""Speed of the draft top-K custom dispatch against IREE's argmax and IREE's linalg_ext.topk, on one device.

    python bench/topk_bench.py build --arch host --out DIR      # compile every arm (needs iree.compiler)
    python bench/topk_bench.py run --device local-task --modules DIR --json OUT.json
    python bench/topk_bench.py all --arch host --device local-task --json ...   # both

At logits [15, 151936], K=8, each arm is timed by iree-benchmark-module (the runtime wheel's
binary, synchronous calls, the median of repetitions):
- custom:   kernels/ top-K with log-probs (T = 1.0);
- argmax:   IREE's argmax over the same logits (the linalg form torch.argmax lowers to), i64 index;
- topk_sN:  iree_linalg_ext.topk values + indices (no log-probs), with
            --iree-dispatch-creation-topk-split-reduction=N (s0: no split).
custom_b16 and argmax_b16 make 16 independent calls on 16 logit blocks in one invocation, so
their time / 16 is the cost per top-K with the per-invocation overhead amortized (the 16 may
overlap on the device). The floor is n*V*4 bytes over the copy bandwidth measured in the same run
(NumPy copy on the host, torch copy on a GPU; bytes read + written over time).
Needs only the IREE runtime and NumPy to run (torch for the GPU bandwidth, when present).
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from common import main, write_json

N, V, K, B = 15, 151936, 8, 16
SPLITS = {"host": (0, 128, 1187), "gpu": (0, 128, 1187, 2374)}


def _argmax_fn(name: str) -> str:
    return f"""util.func private @{name}(%x: tensor<{N}x{V}xf32>) -> tensor<{N}xi64> {{
  %c0 = arith.constant 0 : i64
  %ninf = arith.constant 0xFF800000 : f32
  %ei = tensor.empty() : tensor<{N}xi64>
  %ev = tensor.empty() : tensor<{N}xf32>
  %fi = linalg.fill ins(%c0 : i64) outs(%ei : tensor<{N}xi64>) -> tensor<{N}xi64>
  %fv = linalg.fill ins(%ninf : f32) outs(%ev : tensor<{N}xf32>) -> tensor<{N}xf32>
  %r:2 = linalg.generic {{indexing_maps = [affine_map<(d0, d1) -> (d0, d1)>, affine_map<(d0, d1) -> (d0)>,
      affine_map<(d0, d1) -> (d0)>], iterator_types = ["parallel", "reduction"]}}
      ins(%x : tensor<{N}x{V}xf32>) outs(%fv, %fi : tensor<{N}xf32>, tensor<{N}xi64>) {{
  ^bb0(%in: f32, %acc: f32, %idx: i64):
    %i = linalg.index 1 : index
    %ii = arith.index_cast %i : index to i64
    %mx = arith.maximumf %in, %acc : f32
    %gt = arith.cmpf ogt, %in, %acc : f32
    %ni = arith.select %gt, %ii, %idx : i64
    linalg.yield %mx, %ni : f32, i64
  }} -> (tensor<{N}xf32>, tensor<{N}xi64>)
  util.return %r#1 : tensor<{N}xi64>
}}
"""


def _batched(fn: str, extra_args: str, extra_types: str, results: list[str]) -> str:
    """A public @batched over [B, N, V] that calls FN on each [N, V] block and stacks the results."""
    lines = [f"util.func public @batched(%xs: tensor<{B}x{N}x{V}xf32>{extra_args}) -> "
             f"({', '.join(f'tensor<{B}x{r}>' for r in results)}) {{"]
    for j, r in enumerate(results):
        lines.append(f"  %acc{j}_0 = tensor.empty() : tensor<{B}x{r}>")
    for b in range(B):
        lines.append(f"  %x{b} = tensor.extract_slice %xs[{b}, 0, 0] [1, {N}, {V}] [1, 1, 1] : "
                     f"tensor<{B}x{N}x{V}xf32> to tensor<{N}x{V}xf32>")
        outs = ", ".join(f"tensor<{r}>" for r in results)
        lines.append(f"  %r{b}:{len(results)} = util.call @{fn}(%x{b}{', %t' if extra_args else ''}) : "
                     f"(tensor<{N}x{V}xf32>{extra_types}) -> ({outs})")
        for j, r in enumerate(results):
            rank = r.count("x")
            offs, sizes = ", ".join(["0"] * rank), ", ".join(r.split("x")[:-1])
            lines.append(f"  %acc{j}_{b + 1} = tensor.insert_slice %r{b}#{j} into %acc{j}_{b}[{b}, {offs}] "
                         f"[1, {sizes}] [1{', 1' * rank}] : tensor<{r}> into tensor<{B}x{r}>")
    rets = ", ".join(f"%acc{j}_{B}" for j in range(len(results)))
    lines.append(f"  util.return {rets} : {', '.join(f'tensor<{B}x{r}>' for r in results)}")
    lines.append("}")
    return "\n".join(lines) + "\n"


def _topk_module() -> str:
    return f"""func.func @main(%x: tensor<{N}x{V}xf32>) -> (tensor<{N}x{K}xf32>, tensor<{N}x{K}xi32>) {{
  %ninf = arith.constant 0xFF800000 : f32
  %c0 = arith.constant 0 : i32
  %ev = tensor.empty() : tensor<{N}x{K}xf32>
  %ei = tensor.empty() : tensor<{N}x{K}xi32>
  %fv = linalg.fill ins(%ninf : f32) outs(%ev : tensor<{N}x{K}xf32>) -> tensor<{N}x{K}xf32>
  %fi = linalg.fill ins(%c0 : i32) outs(%ei : tensor<{N}x{K}xi32>) -> tensor<{N}x{K}xi32>
  %r:2 = iree_linalg_ext.topk dimension(1) ins(%x : tensor<{N}x{V}xf32>)
      outs(%fv, %fi : tensor<{N}x{K}xf32>, tensor<{N}x{K}xi32>) {{
  ^bb0(%a: f32, %b: f32):
    %p = arith.cmpf ogt, %a, %b : f32
    iree_linalg_ext.yield %p : i1
  }} -> tensor<{N}x{K}xf32>, tensor<{N}x{K}xi32>
  return %r#0, %r#1 : tensor<{N}x{K}xf32>, tensor<{N}x{K}xi32>
}}
"""


def build(arch: str, out: Path) -> dict:
    """Compiles every arm for ARCH into OUT; returns {arm: (module file, function, takes T)}."""
    import iree.compiler as ic

    from dflash_iree.kernels.topk import device_flags, topk_dispatch

    out.mkdir(parents=True, exist_ok=True)
    d = topk_dispatch(N, V, K, arch)
    res = [f"{N}x{K}xi32", f"{N}x{K}xf32"]
    sources = {
        "custom": (d.mlir + f"""util.func public @main(%x: tensor<{N}x{V}xf32>, %t: f32) -> (tensor<{N}x{K}xi32>, tensor<{N}x{K}xf32>) {{
  %r:2 = util.call @{d.func}(%x, %t) : (tensor<{N}x{V}xf32>, f32) -> (tensor<{N}x{K}xi32>, tensor<{N}x{K}xf32>)
  util.return %r#0, %r#1 : tensor<{N}x{K}xi32>, tensor<{N}x{K}xf32>
}}
""", d.flags),
        "custom_b16": (d.mlir + _batched(d.func, ", %t: f32", ", f32", res), d.flags),
        "argmax": (_argmax_fn("am") + f"""util.func public @main(%x: tensor<{N}x{V}xf32>) -> tensor<{N}xi64> {{
  %r = util.call @am(%x) : (tensor<{N}x{V}xf32>) -> tensor<{N}xi64>
  util.return %r : tensor<{N}xi64>
}}
""", []),
        "argmax_b16": (_argmax_fn("am") + _batched("am", "", "", [f"{N}xi64"]), []),
    }
    for s in SPLITS["host" if arch == "host" else "gpu"]:
        sources[f"topk_s{s}"] = (_topk_module(), [f"--iree-dispatch-creation-topk-split-reduction={s}"] if s else [])
    arms = {}
    for arm, (src, flags) in sources.items():
        path = out / f"{arm}.vmfb"
        ic.compile_str(src, output_file=str(path), extra_args=device_flags(arch) + flags)
        fn = "batched" if arm.endswith("_b16") else "main"
        arms[arm] = {"module": path.name, "function": fn, "temperature": arm.startswith("custom")}
    (out / "arms.json").write_text(json.dumps({"arch": arch, "arms": arms}, indent=1))
    return arms


def _benchmark_binary() -> Path:
    import iree._runtime_libs as libs

    return Path(libs.__file__).parent / "iree-benchmark-module"


def _bandwidth(device: str) -> dict:
    """Copy bandwidth in GB/s (bytes read + written), measured now on the benchmark's device."""
    if device.startswith("local"):
        a = np.ones(1 << 27, np.float32)
        b = np.empty_like(a)
        np.copyto(b, a)
        t = time.perf_counter()
        for _ in range(5):
            np.copyto(b, a)
        dt = (time.perf_counter() - t) / 5
        return {"how": "numpy copy of 512 MiB, one thread", "GBps": 2 * a.nbytes / dt / 1e9}
    import torch

    a = torch.ones(1 << 28, device="cuda")
    b = torch.empty_like(a)
    b.copy_(a)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        b.copy_(a)
    end.record()
    torch.cuda.synchronize()
    dt = start.elapsed_time(end) / 10 / 1e3
    return {"how": "torch copy of 1 GiB, CUDA events", "GBps": 2 * a.numel() * 4 / dt / 1e9,
            "gpu": torch.cuda.get_device_name()}


def _time_arm(cmd: list[str]) -> float | str:
    """Median real time in ms of one iree-benchmark-module run, or its error text."""
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    if r.returncode != 0:
        return (r.stderr or r.stdout)[-400:]
    rows = json.loads(r.stdout[r.stdout.index("{"):])["benchmarks"]
    med = next(b for b in rows if b.get("aggregate_name") == "median" and "real_time" in b["name"])
    return med["real_time"] * {"ns": 1e-6, "us": 1e-3, "ms": 1.0, "s": 1e3}[med["time_unit"]]


def run(device: str, modules: Path, repetitions: int = 5, rounds: int = 1) -> dict:
    """Times every arm in MODULES on DEVICE; returns the results record.

    With rounds > 1 the arms take turns, and each keeps its lowest median: on a shared host this
    keeps another process's burst from landing on one arm only.
    """
    meta = json.loads((modules / "arms.json").read_text())
    load_before = os.getloadavg()
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((N, V)) * 4).astype(np.float32)
    xs = (rng.standard_normal((B, N, V)) * 4).astype(np.float32)
    best: dict[str, float | str] = {}
    with tempfile.TemporaryDirectory() as tmp:
        np.save(Path(tmp) / "x.npy", x)
        np.save(Path(tmp) / "xs.npy", xs)
        for _ in range(rounds):
            for arm, info in meta["arms"].items():
                inputs = [f"--input=@{tmp}/{'xs' if arm.endswith('_b16') else 'x'}.npy"]
                if info["temperature"]:
                    inputs.append("--input=1.0")
                cmd = [str(_benchmark_binary()), f"--module={modules / info['module']}", f"--device={device}",
                       f"--function={info['function']}", *inputs, f"--benchmark_repetitions={repetitions}",
                       "--benchmark_min_time=0.2s", "--benchmark_format=json", "--device_allocator=caching"]
                ms = _time_arm(cmd)
                if isinstance(ms, float) and (not isinstance(best.get(arm), float) or ms < best[arm]):
                    best[arm] = ms
                elif arm not in best:
                    best[arm] = ms
    results = {}
    for arm, ms in best.items():
        if not isinstance(ms, float):
            results[arm] = {"error": ms}
            continue
        results[arm] = {"ms_per_call": ms, **({"ms_per_topk": ms / B} if arm.endswith("_b16") else {})}
        print(f"{arm:12s} {ms:10.4f} ms/call" + (f"   {ms / B:.4f} ms each of {B}" if arm.endswith("_b16") else ""),
              flush=True)
    bw = _bandwidth(device)
    floor_ms = N * V * 4 / (bw["GBps"] * 1e9) * 1e3
    ok = [a for a in results if a.startswith("topk_s") and "ms_per_call" in results[a]]
    best = min(ok, key=lambda a: results[a]["ms_per_call"]) if ok else None
    summary = {}
    if "ms_per_call" in results.get("custom", {}) and "ms_per_call" in results.get("argmax", {}):
        summary["custom_over_argmax_per_call"] = results["custom"]["ms_per_call"] / results["argmax"]["ms_per_call"]
    if "ms_per_topk" in results.get("custom_b16", {}) and "ms_per_topk" in results.get("argmax_b16", {}):
        summary["custom_over_argmax_batched"] = results["custom_b16"]["ms_per_topk"] / results["argmax_b16"]["ms_per_topk"]
    return {"shape": {"n": N, "V": V, "K": K, "batch": B}, "device": device, "arch": meta["arch"],
            "host": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
            "loadavg_1m_before_after": [load_before[0], os.getloadavg()[0]], "bandwidth": bw, "floor_ms": floor_ms,
            "best_topk_split": best, "arms": results, "summary": summary,
            "timing": f"iree-benchmark-module median of {repetitions} repetitions, --device_allocator=caching"
                      + (f", lowest of {rounds} rounds taken in turn" if rounds > 1 else "")}


def _options(p) -> None:
    p.add_argument("--arch", default="host")
    p.add_argument("--device", default="local-task")
    p.add_argument("--modules", "--out", type=Path, dest="modules")
    p.add_argument("--json", type=Path)
    p.add_argument("--rounds", type=int, default=1, help="timing rounds, arms in turn; each arm keeps its lowest")


def _steps(build_arms: bool, run_arms: bool):
    def steps(args) -> None:
        with tempfile.TemporaryDirectory() as tmp:
            modules = args.modules or Path(tmp)
            if build_arms:
                build(args.arch, modules)
            if run_arms:
                rec = run(args.device, modules, rounds=args.rounds)
                print(json.dumps(rec["summary"]), f"floor {rec['floor_ms']:.4f} ms", f"best split {rec['best_topk_split']}")
                if args.json:
                    write_json(args.json, rec)

    return steps


if __name__ == "__main__":
    sys.exit(main(__doc__, {"build": (_steps(True, False), _options), "run": (_steps(False, True), _options),
                            "all": (_steps(True, True), _options)}))
