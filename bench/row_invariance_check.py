"""Row invariance on a GPU (issue #24): decode's logits row against verify's row, bit for bit.

    .venv/bin/python bench/row_invariance_check.py prepare [--arch sm_80] [--models demo 8b demo-mlx4]   # here
    bash bench/on_device.sh python3 bench/row_invariance_check.py run --json OUT.json           # on the GPU

`prepare` exports each model's target with the debug functions of export/row_check.py (every layer's
output and the float32 logits of a decode and of a verify) and compiles it for ARCH in each build of
BUILDS into .gpu/rows-ARCH/ (git-ignored; carry it with bench/pack_device.py):

- "row-invariant": the lowerings as `make compile` runs them (export/splice.py LOWERINGS): every
  linear on the skinny GEMM at every row count, decode's too, with no weight floor
  (export/lower_linear.py), and decode's attention on the block-attention kernel
  (export/lower_attention.py): the two kernels whose numerics contracts say a row does not depend on
  the call's rows;
- "before": the rules before row invariance (`row_invariant=False`, ATTENTION_MIN_ROWS): decode's
  lone weights, gate/up and attention on IREE's ops, the 4 MiB weight floor;
- "planted-split" (the planted control): "row-invariant", except that every M = 1 skinny GEMM takes
  another k split than the plan's (twice the splits where K allows, else half). It must part.

`run` binds the weights (demo: the committed checkpoint; demo-mlx4: its mlx-lm-written 4-bit copy; 8b: tests/fixtures/qwen3-8b's shapes with
random bf16 weights, the module's own initialization, seeded), prefills a prompt, verifies a block
after it and decodes the block's tokens one by one at the same positions, then counts the
elements where decode j and verify row j differ: per layer, the logits, the greedy token. Prints a
table and writes the JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
WORK = ROOT / ".gpu"
MODELS = {  # name -> (target, drafter, verify block, cache rows, prompt tokens)
    "demo": (ROOT / "models" / "demo" / "target", ROOT / "models" / "demo" / "drafter", 8, 256, 40),
    "8b": (ROOT / "tests" / "fixtures" / "qwen3-8b", ROOT / "tests" / "fixtures" / "qwen3-8b-dflash-b16", 16, 1024, 500),
    # the demo target written 4-bit by mlx-lm (group 64; experiments/2026-12-03-q4-gpu/README.md)
    "demo-mlx4": (WORK / "demo-mlx4-target", ROOT / "models" / "demo" / "drafter", 8, 256, 40),
}
BUILDS = ("before", "row-invariant", "planted-split")


def _planted_gemm(real):
    """gemm_dispatch with another k split at M = 1 (the planted control)."""
    from dflash_iree.kernels.gemm.dispatch import chunk_k, gemm_plan

    def dispatch(M, N, K, arch, **kw):
        if M == 1:
            plan = gemm_plan(N, K, arch, paired=kw.get("epilogue") == "swiglu")
            chunks = K // chunk_k(arch)
            kw["splits"] = next(s for s in (plan.splits * 2, plan.splits // 2, plan.splits * 3)
                                if s >= 1 and chunks % s == 0)
        return real(M, N, K, arch, **kw)

    return dispatch


def splices(build: str) -> dict | None:
    """The lowerings of BUILD (module docstring); None for the default."""
    from dflash_iree.export import splice

    if build == "row-invariant":
        return None
    out = splice.before_row_invariance() if build == "before" else dict(splice.LOWERINGS)
    if build == "planted-split":
        def gemm(module, arch):
            import dflash_iree.kernels.gemm as g

            real = g.gemm_dispatch
            g.gemm_dispatch = _planted_gemm(real)
            try:
                return splice.lower_linear(module, arch)
            finally:
                g.gemm_dispatch = real
        out["gemm"] = gemm
    return out


def prepare(arch: str, models: list[str], builds: list[str]) -> None:
    from dflash_iree.arch import ARCHS
    from dflash_iree.export.iree_tool import run_iree_compile
    from dflash_iree.export.row_check import export_row_module
    from dflash_iree.export.splice import splice_file

    out = WORK / f"rows-{arch}"
    out.mkdir(parents=True, exist_ok=True)
    meta = {}
    for name in models:
        target, drafter, block, context, _ = MODELS[name]
        mlir = out / f"{name}.mlir"
        L, H, V = export_row_module(target, drafter, mlir, block, context, ARCHS[arch].attention)
        meta[name] = {"layers": L, "hidden": H, "vocab": V}
        for build in builds:
            spliced, flags, report = splice_file(mlir, out / f"{name}-{build}.mlirbc", arch, splices(build))
            vmfb = out / f"{name}-{build}.vmfb"
            run_iree_compile(spliced, vmfb, list(ARCHS[arch].flags) + flags, vmfb.with_suffix(".csv"))
            meta[name][build] = {"iree": report.get("iree", {}), "gemm": report.get("gemm", [])}
            print(f"{name} {build}: {vmfb} ({vmfb.stat().st_size / 2**20:.1f} MiB)", flush=True)
        mlir.unlink()
    (out / "meta.json").write_text(json.dumps({"arch": arch, "models": meta}, indent=1))


def _random_weights(target_dir: Path, keep: list):
    """The 8B shape's target parameters, the module's own seeded initialization, as host bf16 bits."""
    import torch

    from dflash_iree.config import load_target_config
    from dflash_iree.export.qwen3 import Qwen3

    torch.manual_seed(0)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    with torch.device(dev):
        target = Qwen3(load_target_config(target_dir), 64, (), 1, torch.bfloat16)
    out = {}
    for key, p in target.named_parameters():
        host = p.detach().view(torch.int16).cpu().numpy()
        keep.append(host)
        out[key] = host
    del target
    return out


def run(json_out: Path, device_name: str) -> int:
    import iree.runtime as rt

    from dflash_iree.checkpoint import index_checkpoint
    from dflash_iree.export.entry_points import KV_PAGE
    from dflash_iree.export.row_check import DEBUG_FUNCTIONS, compare_rows, parts

    folder = next(WORK.glob("rows-*"))
    meta = json.loads((folder / "meta.json").read_text())
    inst, dev = rt.VmInstance(), rt.get_device(device_name)
    result = {"arch": meta["arch"], "device": device_name, "models": {}}
    keep: list = []
    for name, m in meta["models"].items():
        target, _, block, _, prompt_len = MODELS[name]
        L, H, V = m["layers"], m["hidden"], m["vocab"]
        index = rt.ParameterIndex()
        if name == "8b":
            for key, host in _random_weights(target, keep).items():
                index.add_buffer(key, host)
        else:
            for f in sorted({i.file for i in index_checkpoint(target).values()}):
                index.load(str(f))
        rng = np.random.default_rng(0)
        prompt, tokens = rng.integers(10, V, prompt_len), rng.integers(10, V, block)
        result["models"][name] = {}
        for build in BUILDS:
            vmfb = folder / f"{name}-{build}.vmfb"
            if not vmfb.exists():
                continue
            vm = rt.VmModule.mmap(inst, str(vmfb))
            ctx = rt.VmContext(inst, modules=[rt.create_hal_module(inst, dev),
                                              rt.create_io_parameters_module(inst, index.create_provider(scope="target")),
                                              vm])
            fn = {n: rt.FunctionInvoker(ctx, dev, vm.lookup_function(n)) for n in DEBUG_FUNCTIONS}
            got = parts(compare_rows(fn, L, H, V, block, prompt, tokens, KV_PAGE))
            first = next((k for k, v in got.items() if k.startswith("layer") and v), None)
            result["models"][name][build] = {"parts": got, "first_layer_parted": first,
                                             "row_invariant": all(v == 0 for v in got.values())}
            print(f"{name:5} {build:14} logits {got['logits']:>7} of {block * V}  chosen {got['chosen']}/{block}  "
                  f"first layer parted {first}", flush=True)
            del fn, ctx, vm
    json_out.parent.mkdir(parents=True, exist_ok=True)
    json_out.write_text(json.dumps(result, indent=1))
    ok = all(r["row_invariant"] for m in result["models"].values() for b, r in m.items() if b == "row-invariant")
    planted = all(not r["row_invariant"] for m in result["models"].values() for b, r in m.items()
                  if b == "planted-split")
    print(f"row-invariant build invariant: {ok}; planted control parts: {planted}")
    return 0 if ok and planted else 1


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("prepare")
    p.add_argument("--arch", default="sm_80")
    p.add_argument("--models", nargs="+", default=["demo", "8b"], choices=list(MODELS))
    p.add_argument("--builds", nargs="+", default=list(BUILDS), choices=list(BUILDS))
    r = sub.add_parser("run")
    r.add_argument("--json", type=Path, default=WORK / "row_invariance.json")
    r.add_argument("--device", default="cuda")
    args = ap.parse_args()
    if args.cmd == "prepare":
        prepare(args.arch, args.models, args.builds)
        return 0
    return run(args.json, args.device)


if __name__ == "__main__":
    sys.exit(main())
