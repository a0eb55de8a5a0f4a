"""How the cost of one call grows with the decode steps it runs (issue #24, "fewer calls per token").

    .venv/bin/python experiments/2026-12-03-decode-steps/probe.py prepare        # here: ~10 min
    bash bench/on_device.sh python3 experiments/2026-12-03-decode-steps/probe.py run --json OUT.json

The Qwen3-8B-shaped target (tests/fixtures/qwen3-8b, random bf16 weights on the device) exported with
`prefill`, `decode` and `decode_steps` at k = 2, 4 and 8 (export/entry_points.py `decode_steps`: k
decode steps in one call, each step's token fed to the next on the device), lowered with the
row-invariant rules (bench/row_invariance_check.py), compiled for sm_80 into .gpu/steps-sm_80/.
`run` prefills 512 random tokens, then per arm (k = 1 is `decode`) times 64 tokens' worth of calls,
synchronous as FunctionInvoker makes them, alternated over 3 rounds, and checks that every arm's
tokens are decode's, token for token. Prints ms per token and per call, and writes the JSON.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
WORK = ROOT / ".gpu" / "steps-sm_80"
TARGET = ROOT / "tests/fixtures/qwen3-8b"
DRAFTER = ROOT / "tests/fixtures/qwen3-8b-dflash-b16"
KS = (2, 4, 8)
CONTEXT, PROMPT, TOKENS, ROUNDS = 4096, 512, 64, 3


def prepare() -> None:
    import torch

    from dflash_iree.arch import ARCHS
    from dflash_iree.config import load_drafter_config, load_target_config
    from dflash_iree.export import aot, entry_points as ep, splice
    from dflash_iree.export.dflash import DFlashDrafter
    from dflash_iree.export.iree_tool import run_iree_compile
    from dflash_iree.export.qwen3 import Qwen3

    WORK.mkdir(parents=True, exist_ok=True)
    tcfg = load_target_config(TARGET)
    dcfg = load_drafter_config(DRAFTER, tcfg)
    with torch.device("meta"):
        target = Qwen3(tcfg, CONTEXT, (), 1, torch.bfloat16, attention="fused")
        drafter = DFlashDrafter(dcfg, CONTEXT, 16, 1, torch.bfloat16, attention="fused")
    pair = aot.Pair(target, drafter).eval()
    pair.requires_grad_(False)
    T = ep.TensorSpec
    args = (T("tokens", (1, 1), "i64"), T("start", (1,), "i64"), T("pages", ("P",), "i8"))
    debug = [(ep.EntryPoint(f"decode_steps_{k}", "target", args + (T("chosen", (1, k), "i64"),), (), "", ("chosen",)),
              ep.decode_steps) for k in KS]
    shapes = ep.ExportShapes(1, 16, CONTEXT, "bf16", 0)
    t0 = time.perf_counter()
    out, _ = aot.export_module(pair, shapes, sampled=False, only=("prefill", "decode"), debug=debug)
    out.save_mlir(WORK / "m.mlir")
    export_s = time.perf_counter() - t0
    splices = dict(splice.LOWERINGS)
    splices["gemm"] = functools.partial(splice.lower_linear, row_invariant=True)
    splices["attention"] = functools.partial(splice.lower_attention, min_rows=1)
    src, flags, _ = splice.splice_file(WORK / "m.mlir", WORK / "m.mlirbc", "sm_80", splices)
    t0 = time.perf_counter()
    run_iree_compile(src, WORK / "m.vmfb", list(ARCHS["sm_80"].flags) + flags, WORK / "m.csv")
    meta = {"export_s": round(export_s, 1), "compile_s": round(time.perf_counter() - t0, 1),
            "vmfb_mib": round((WORK / "m.vmfb").stat().st_size / 2**20, 2), "ks": KS}
    (WORK / "meta.json").write_text(json.dumps(meta))
    (WORK / "m.mlir").unlink()
    print(meta)


def run(json_out: Path) -> None:
    import iree.runtime as rt
    import torch

    from dflash_iree.config import load_target_config
    from dflash_iree.export.entry_points import KV_PAGE
    from dflash_iree.export.qwen3 import Qwen3

    torch.manual_seed(0)
    with torch.device("cuda"):
        target = Qwen3(load_target_config(TARGET), 64, (), 1, torch.bfloat16)
    index, keep = rt.ParameterIndex(), []
    for key, p in target.named_parameters():
        host = p.detach().view(torch.int16).cpu().numpy()
        keep.append(host)
        index.add_buffer(key, host)
    del target
    torch.cuda.empty_cache()
    inst, dev = rt.VmInstance(), rt.get_device("cuda")
    vm = rt.VmModule.mmap(inst, str(WORK / "m.vmfb"))
    ctx = rt.VmContext(inst, modules=[rt.create_hal_module(inst, dev),
                                      rt.create_io_parameters_module(inst, index.create_provider(scope="target")), vm])
    fn = {n: rt.FunctionInvoker(ctx, dev, vm.lookup_function(n))
          for n in ("prefill", "decode", *(f"decode_steps_{k}" for k in KS))}
    rng = np.random.default_rng(0)
    prompt = rng.integers(10, 150000, PROMPT)
    pages = lambda rows: np.zeros(-(-rows // KV_PAGE), np.int8)  # noqa: E731
    first = np.zeros((1, 1), np.int64)
    fn["prefill"](prompt[None], np.array([0]), pages(PROMPT), first)

    def arm(k: int) -> tuple[float, list[int]]:
        tok, got = first.copy(), []
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for i in range(0, TOKENS, k):
            pos = PROMPT + i
            if k == 1:
                out = np.zeros((1, 1), np.int64)
                fn["decode"](tok, np.array([pos]), pages(pos + 1), out)
            else:
                out = np.zeros((1, k), np.int64)
                fn[f"decode_steps_{k}"](tok, np.array([pos]), pages(pos + k), out)
            got += out[0].tolist()
            tok = out[:, -1:].copy()
        return (time.perf_counter() - t0) * 1e3 / TOKENS, got

    arms = (1, *KS)
    for k in arms:
        arm(k)  # warm-up
    ms = {k: [] for k in arms}
    tokens = {}
    for r in range(ROUNDS):
        for k in arms[r % len(arms):] + arms[:r % len(arms)]:
            t, tokens[k] = arm(k)
            ms[k].append(t)
            print(json.dumps({"round": r, "k": k, "ms_per_token": round(t, 4)}), flush=True)
    med = {k: statistics.median(v) for k, v in ms.items()}
    out = {"device": torch.cuda.get_device_name(0), "prompt": PROMPT, "tokens": TOKENS, "rounds": ROUNDS,
           "meta": json.loads((WORK / "meta.json").read_text()), "ms_per_token": ms,
           "median_ms_per_token": med, "median_ms_per_call": {k: med[k] * k for k in arms},
           "over_decode": {k: med[k] / med[1] for k in arms},
           "same_tokens_as_decode": {k: tokens[k] == tokens[1] for k in KS}}
    print("| k | ms/token | ms/call | /decode | tokens == decode |\n|---|---|---|---|---|")
    for k in arms:
        print(f"| {k} | {med[k]:.3f} | {med[k] * k:.3f} | {med[k] / med[1]:.3f} | "
              f"{'-' if k == 1 else out['same_tokens_as_decode'][k]} |")
    json_out.parent.mkdir(parents=True, exist_ok=True)
    json_out.write_text(json.dumps(out, indent=1))


def main() -> None:
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("prepare")
    r = sub.add_parser("run")
    r.add_argument("--json", type=Path, required=True)
    a = ap.parse_args()
    prepare() if a.cmd == "prepare" else run(a.json)


if __name__ == "__main__":
    sys.exit(main())
