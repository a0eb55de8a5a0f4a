"""Qwen3-8B-shaped speed on a GPU: decode, verify and draft steps against bandwidth and PyTorch peers.

    python bench/speed_8b.py prepare [--arch h200]          # here: compile the 8B pair (block 16, and block 8)
    python bench/speed_8b.py prepare --blocks 8 --variant att --without epilogues   # a variant beside it
    PYTHONPATH=. python bench/speed_8b.py run --json OUT    # on the GPU machine (iree.runtime + torch with CUDA)
    python bench/speed_8b.py report OUT                     # here: the table of docs/benchmarks.md

The target is tests/fixtures/qwen3-8b (36 layers, hidden 4096, untied, bf16) and the drafter
tests/fixtures/qwen3-8b-dflash-b16 (5 layers, taps [1, 9, 17, 25, 33]). No checkpoint travels: `run`
builds our own `export/` modules on the GPU, whose default initialization is the random bf16 weights,
and binds the very same tensors (copied to host memory once) into the compiled module through
`iree.runtime.ParameterIndex.add_buffer`. Everything below is measured in that one process:

- copy bandwidth: a 4 GiB device-to-device copy (torch), 2 x bytes / time;
- IREE decode (1 token), verify (block 16; block 8 from the second artifact when present) and draft
  (block 16) steps, each a synchronous call as the runtime makes it, chosen tokens read back; after a
  512-token prefill, so attention reads ~530 cache rows; a round as two calls (draft, verify) and as
  one (`verify_draft`, when the artifact has it); and plain decoding as the runtime runs it,
  `CompiledPair.decode_ahead` (64 tokens, the device one step ahead of the host), per token;
- with `--profile`, the device time of every kernel of those steps, from CUPTI through
  torch.profiler (it records the kernels IREE launches in the same process too): kernels per call
  (device-to-device copies included), busy ms per call against the wall ms, and the kernels that
  take the most time; and the host's timeline of decode and verify (`_host_timeline`: when the
  first and last `cuLaunchKernel` come, when the GPU starts and ends, its idle time), for calls as
  the runtime makes them, for bare invocations, and for plain decoding's steps in a row;
- achieved bandwidth of decode = the target's weight bytes read per step (every parameter but the
  embedding table) x steps per second;
- peers on the same weights: the same `Qwen3` module in PyTorch eager, and under `torch.compile`
  (default mode, and "reduce-overhead", which adds CUDA graphs), 64 decode steps chained on the device,
  attending over the same number of cache rows.

Goals (issues 7 and 8): decode >= 70% of copy bandwidth and not slower than torch.compile;
verify/decode <= 1.3; draft/verify <= 1.1 x (drafter bytes + lm_head bytes) / target bytes.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TARGET = ROOT / "tests" / "fixtures" / "qwen3-8b"
DRAFTER = ROOT / "tests" / "fixtures" / "qwen3-8b-dflash-b16"
WORK = ROOT / ".gpu"
PROMPT_LEN = 512
MAX_CONTEXT = 1024  # the torch peers' cache: the steps never reach past it
STEPS = 64
DEV = "cuda"


def artifact_dir(arch: str, block: int, variant: str = "") -> Path:
    return WORK / f"8b-b{block}{variant}-{arch}"


# What `prepare --without` can leave out, for a variant measured beside the full build.
WITHOUT = ("epilogues", "decode-qkv", "norm-rope-pairs")


def prepare(arch: str, blocks: list[int], variant: str = "", without: tuple[str, ...] = ()) -> None:
    """Compile the 8B pair as `make compile` does (max_context 4096) for `arch` at each block size into
    .gpu/ (git-ignored; carry it). WITHOUT (with a VARIANT name): "epilogues", o_proj, down_proj and
    gate/up with their elementwise ops on IREE's matmuls (the linears with an epilogue); "decode-qkv",
    decode's q, k and v as IREE's three matvecs; "norm-rope-pairs", q's and k's norm + rope as two
    dispatches."""
    import functools

    from dflash_iree.export import splice
    from dflash_iree.export.compile import compile_artifacts, resolve_arch

    splices = dict(splice.LOWERINGS)
    if {"epilogues", "decode-qkv"} & set(without):
        splices["gemm"] = functools.partial(splice.lower_linear, epilogues="epilogues" not in without,
                                            decode_qkv="decode-qkv" not in without)
    if "norm-rope-pairs" in without:
        splices["norm_rope"] = functools.partial(splice.lower_norm_rope, pairs=False)
    name = resolve_arch(arch)[0].name
    for block in blocks:
        compile_artifacts(arch, TARGET, DRAFTER, artifact_dir(name, block, variant), block_size=block, dtype="bf16",
                          splices=splices if without else None)


# ---------------------------------------------------------------- on the GPU


def _times(fn, n: int, warmup: int = 3) -> list[float]:
    """Wall ms of `n` calls of fn() after `warmup` calls; fn must return only when its work is done."""
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t0) * 1e3)
    return out


def _summary(ms: list[float]) -> dict:
    q = statistics.quantiles(ms, n=10)
    return {"median_ms": round(statistics.median(ms), 4), "p10_ms": round(q[0], 4), "p90_ms": round(q[-1], 4),
            "n": len(ms)}


def _copy_bandwidth(torch) -> dict:
    n = 4 * 2**30
    src = torch.empty(n, dtype=torch.uint8, device=DEV)
    dst = torch.empty_like(src)

    def copy():
        dst.copy_(src)
        torch.cuda.synchronize()

    ms = _times(copy, 20)
    s = _summary(ms)
    del src, dst
    torch.cuda.empty_cache()
    return {**s, "bytes": n, "tb_per_s": round(2 * n / (s["median_ms"] * 1e-3) / 1e12, 3)}


def _bytes(module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters())


def _build(torch):
    """Target and drafter on the GPU with random bf16 weights (the modules' own initialization)."""
    from dflash_iree.config import load_drafter_config, load_target_config
    from dflash_iree.export.dflash import DFlashDrafter
    from dflash_iree.export.qwen3 import Qwen3

    tcfg = load_target_config(TARGET)
    dcfg = load_drafter_config(DRAFTER, tcfg)
    torch.manual_seed(0)
    with torch.device(DEV):
        target = Qwen3(tcfg, MAX_CONTEXT, (), 1, torch.bfloat16).eval()
        drafter = DFlashDrafter(dcfg, MAX_CONTEXT, dcfg.block_size, 1, torch.bfloat16).eval()
    target.requires_grad_(False)
    drafter.requires_grad_(False)
    return target, drafter


def _indexes(target, drafter, keep: list):
    """One ParameterIndex per scope holding host copies of the GPU tensors (kept alive in `keep`)."""
    import iree.runtime as rt
    import torch

    out = {}
    for scope, module in (("target", target), ("drafter", drafter)):
        index = rt.ParameterIndex()
        for key, p in module.named_parameters():
            host = p.detach().view(torch.int16).cpu().numpy() if p.dtype == torch.bfloat16 else p.detach().cpu().numpy()
            keep.append(host)
            index.add_buffer(key, host)
        out[scope] = index
    return out


def _profile(fn, wall_ms: float, n: int = 10, top: int = 25, per: int = 1) -> dict:
    """Kernel times of `n` calls of fn() from CUPTI (torch.profiler, device activity only), per step
    (`per` steps a call; wall_ms is per step)."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            fn()
    steps = n * per
    rows = [(e.key, e.count / steps, e.device_time_total / steps / 1e3) for e in prof.key_averages()
            if e.device_time_total > 0]
    rows.sort(key=lambda r: -r[2])
    busy = sum(r[2] for r in rows)
    return {"kernels_per_call": round(sum(r[1] for r in rows), 1), "busy_ms": round(busy, 4), "wall_ms": wall_ms,
            "busy_fraction": round(busy / wall_ms, 3) if wall_ms else None,
            "top": [{"kernel": k[:160], "per_call": round(c, 2), "ms": round(ms, 4)} for k, c, ms in rows[:top]]}


def _timeline_rows(events: list) -> tuple:
    """_host_timeline's per-step rows from a chrome trace's complete ("X") events."""
    steps = sorted((e for e in events if e["name"] == "dflash_step"), key=lambda e: e["ts"])
    driver = [e for e in events if e.get("cat") == "cuda_driver"]
    gpu = {e["args"]["correlation"]: e for e in events
           if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and "correlation" in e.get("args", {})}
    rows = []
    for s in steps:
        t0, t1 = s["ts"], s["ts"] + s["dur"]
        calls = sorted((e for e in driver if t0 <= e["ts"] <= t1), key=lambda e: e["ts"])
        launches = [e for e in calls if e["name"].startswith("cuLaunch")]
        if not launches:
            continue
        between = [b["ts"] - (a["ts"] + a["dur"]) for a, b in zip(launches, launches[1:])]
        # (GPU op, the driver call that launched it), in GPU order
        work = sorted(((gpu[c["args"]["correlation"]], c) for c in calls if c.get("args", {}).get("correlation") in gpu),
                      key=lambda p: p[0]["ts"])
        busy = sum(g["dur"] for g, _ in work)
        waiting, long_gaps, prev_end = 0.0, [], None
        for g, c in work:
            if prev_end is not None and g["ts"] > prev_end:
                if c["ts"] + c["dur"] > prev_end:
                    waiting += g["ts"] - prev_end
                if g["ts"] - prev_end > 50:  # between plain decoding's steps, say
                    long_gaps.append(g["ts"] - prev_end)
            prev_end = g["ts"] + g["dur"] if prev_end is None else max(prev_end, g["ts"] + g["dur"])
        by_name: dict = {}
        for e in calls:
            k = by_name.setdefault(e["name"], [0, 0.0])
            k[0] += 1
            k[1] += e["dur"]
        rows.append({"step_us": s["dur"], "launches": len(launches), "first_launch_us": launches[0]["ts"] - t0,
                     "last_launch_end_us": launches[-1]["ts"] + launches[-1]["dur"] - t0,
                     "in_launches_us": sum(e["dur"] for e in launches),
                     "between_launches_us": sum(between), "between_launches_median_us": statistics.median(between),
                     "gpu_start_us": work[0][0]["ts"] - t0 if work else None,
                     "gpu_end_us": max(g["ts"] + g["dur"] for g, _ in work) - t0 if work else None,
                     "gpu_busy_us": busy, "gpu_waiting_for_launch_us": waiting,
                     "gpu_gaps_over_50us": len(long_gaps), "gpu_gaps_over_50us_us": sum(long_gaps),
                     "driver_calls": by_name})
    return steps, driver, rows


def _host_timeline(fn, n: int = 8, trace: Path | None = None) -> dict:
    """Where the host's time of a step goes, from CUPTI's driver-API records (torch.profiler): each
    `cuLaunchKernel` IREE makes, with its host start and duration, joined to the kernel it launched.
    Per step (medians over n calls of fn()), in µs from the step's start: the first and last launch,
    the launches and the time inside them, the other driver calls by name, the time between one
    launch's end and the next one's start (the VM and HAL's own work per dispatch), when the GPU
    starts and ends, its busy time, and its idle time while it waits for a launch (a gap before a
    kernel whose launch ended after the kernel before it finished). `trace`: also write the first
    profiled step's chrome trace there."""
    import tempfile

    from torch.profiler import ProfilerActivity, profile, record_function

    fn()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            with record_function("dflash_step"):
                fn()
    with tempfile.TemporaryDirectory() as tmp:
        prof.export_chrome_trace(f"{tmp}/t.json")
        events = [e for e in json.loads(Path(f"{tmp}/t.json").read_text())["traceEvents"] if e.get("ph") == "X"]
    steps, driver, rows = _timeline_rows(events)
    if trace is not None and steps:
        t0, t1 = steps[0]["ts"], steps[0]["ts"] + steps[0]["dur"]
        first = [e for e in events if t0 <= e["ts"] <= t1 or e.get("args", {}).get("correlation") in
                 {c.get("args", {}).get("correlation") for c in driver if t0 <= c["ts"] <= t1}]
        trace.write_text(json.dumps({"traceEvents": first}))
    med = {k: round(statistics.median(r[k] for r in rows), 1) for k in rows[0] if k != "driver_calls"}
    names = {k for r in rows for k in r["driver_calls"]}
    med["driver_calls"] = {k: {"per_step": statistics.median(r["driver_calls"].get(k, [0, 0])[0] for r in rows),
                               "us_per_step": round(statistics.median(r["driver_calls"].get(k, [0, 0])[1] for r in rows), 1)}
                           for k in sorted(names)}
    med["steps"] = len(rows)
    return med


def _async_call(pair, name: str, arrays: list):
    """(invoke, wait) for `name$async` on arguments staged once: invoke() queues one call with its
    wait fence already signaled, wait() returns when the last one's fence signals."""
    import iree.runtime as rt

    fn = pair._async_function(name)
    sem = pair.device.create_semaphore(0)
    views = [a._buffer_view if hasattr(a, "_buffer_view") else pair._stage.arg(a)._buffer_view for a in arrays]
    calls = 0

    def invoke():
        nonlocal calls
        args = rt.VmVariantList(len(views) + 2)
        for ref in views + [rt.HalFence.create_at(sem, calls), rt.HalFence.create_at(sem, calls + 1)]:
            args.push_ref(ref)
        pair._context.invoke(fn, args, rt.VmVariantList(4))
        calls += 1

    def wait():
        rt.HalFence.create_at(sem, calls).wait()

    return invoke, wait


def _invoke_only(pair, name: str, arrays: list):
    """A call of `name$async` without the runtime's argument and result handling (`_async_call`)."""
    invoke, wait = _async_call(pair, name, arrays)

    def call():
        invoke()
        wait()

    return call


def _issue_ms(pair, name: str, arrays: list, n: int = 16) -> dict:
    """Where a synchronous call's host time goes: `name$async` invoked with its wait fence already
    signaled and the device idle. "issue": until the invoke returns (the VM records the step's
    command buffer, and the driver launches its kernels); "done": from there until the step's fence
    signals. Medians over n calls. On the pinned CUDA HAL the invocation itself waits for the
    step's work (its transients are freed at the end), so "issue" includes the GPU's tail."""
    invoke, wait = _async_call(pair, name, arrays)
    issue, done = [], []
    for i in range(n + 2):
        t0 = time.perf_counter()
        invoke()
        t1 = time.perf_counter()
        wait()
        if i >= 2:
            issue.append((t1 - t0) * 1e3)
            done.append((time.perf_counter() - t1) * 1e3)
    return {"issue_ms": round(statistics.median(issue), 4), "done_ms": round(statistics.median(done), 4)}


def _iree_steps(folder: Path, indexes: dict, device, rows: int, profile: bool = False,
                traces: Path | None = None) -> dict:
    """decode / verify / draft step times of one compiled artifact, after a PROMPT_LEN prefill."""
    import numpy as np

    from dflash_iree.runtime.artifacts import Artifacts

    arts = Artifacts.load(folder)
    t0 = time.perf_counter()
    pair = arts.bind_indexes(device, indexes)
    B = arts.block_size
    prompt = [(7 * i + 3) % 1000 + 10 for i in range(PROMPT_LEN)]
    first, taps = pair.prefill(prompt)
    pair.absorb(taps)
    load_s = time.perf_counter() - t0
    m = arts.manifest
    out = {"artifact": folder.name, "arch": arts.arch, "block_size": B, "load_and_prefill_s": round(load_s, 2),
           "flags": m.flags, "dispatches_per_call": m.stats["dispatches_per_call"],
           "gemm_spliced": sum(g.get("mms", g["ops"]) for g in m.splices.get("gemm", []))}

    start = PROMPT_LEN
    state = {"tok": first, "pos": start}

    def decode():
        state["tok"] = pair.decode(state["tok"], state["pos"])
        state["pos"] += 1

    out["decode"] = _summary(_times(decode, STEPS))

    tok, ref = first, []
    for i in range(16):
        tok = pair.decode(tok, start + i)
        ref.append(tok)
    out["decode_ahead_same_tokens"] = list(pair.decode_ahead(first, start, 16)) == ref
    # verify over decode's own tokens must pick them again, except at a bf16 near-tie: a check of the
    # verify graph's custom dispatches (GEMMs and their epilogues, block attention) against decode's
    picked, _ = pair.verify([first] + ref[:B - 1], start)
    out["verify_agrees_with_decode"] = f"{sum(a == b for a, b in zip(picked, ref[:B]))}/{B}"

    def ahead():  # the runtime's plain decoding: STEPS tokens from the same position each time
        for _ in pair.decode_ahead(first, start, STEPS):
            pass

    out["decode_ahead"] = _summary([ms / STEPS for ms in _times(ahead, 8, warmup=1)])
    block = [first] + [11 + i for i in range(B - 1)]
    verify_taps = {}

    def verify():
        _, verify_taps["t"] = pair.verify(block, start)  # the same block again: rollback by length

    out["verify"] = _summary(_times(verify, 32))

    def draft():
        pair.draft(verify_taps["t"], start, B, block[-1], start + B)

    out["draft"] = _summary(_times(draft, 32))

    def round_():
        draft()
        verify()

    out["round"] = _summary(_times(round_, 32))
    steps = {"decode": decode, "decode_ahead": ahead, "verify": verify, "draft": draft}
    if pair.has_verify_draft():
        def fused():
            pair.verify_draft(block, start)

        out["round_fused"] = _summary(_times(fused, 32))
        steps["verify_draft"] = fused
    if profile:
        walls = {name: out[name]["median_ms"] for name in steps if name in out}
        walls["verify_draft"] = out.get("round_fused", {}).get("median_ms")
        out["profile"] = {name: _profile(fn, walls[name], *((2, 25, STEPS) if name == "decode_ahead" else ()))
                          for name, fn in steps.items()}  # decode_ahead: per token, over 2 x STEPS
        out["host_timeline"] = {
            name: _host_timeline(steps[name], trace=traces / f"trace_{folder.name}_{name}.json" if traces else None)
            for name in ("decode", "verify")}
        i64 = np.int64
        decode_args = [np.array([[first]], i64), np.array([start], i64), pair._pages(start + 1), pair._out(1, 1)]
        verify_args = [np.array([block], i64), np.array([start], i64), pair._pages(start + B), pair._out(1, B)]
        # the VM alone (arguments staged once, no result read), and plain decoding's steps in a row
        out["host_timeline"]["decode_invoke"] = _host_timeline(_invoke_only(pair, "decode", decode_args))
        out["host_timeline"]["verify_invoke"] = _host_timeline(_invoke_only(pair, "verify", verify_args))

        def ahead16():
            for _ in pair.decode_ahead(first, start, 16):
                pass

        out["host_timeline"]["decode_ahead_16"] = _host_timeline(ahead16, n=4)
        out["issue"] = {
            "decode": _issue_ms(pair, "decode", decode_args),
            "verify": _issue_ms(pair, "verify", verify_args),
            "draft": _issue_ms(pair, "draft", [*pair._draft_args(verify_taps["t"], start, B, block[-1], start + B),
                                               pair._out(1, B - 1)])}
    out["decode_cache_rows"] = rows
    del pair
    return out


def _torch_decode(torch, target, mode: str | None, rows: int) -> dict:
    """tok/s of 64 chained greedy decode steps of our Qwen3 module, eager or torch.compile(mode)."""
    target.kv_cache.zero_()

    def step(tok, start):
        return target(tok, start, None, read_len=rows)[0]

    compiled = step if mode is None else torch.compile(step, mode=mode, fullgraph=True)
    graphs = mode is not None and "overhead" in mode

    def fn(tok, start):
        if graphs:  # a CUDA graph's output is overwritten by its next replay: mark the step, copy the token
            torch.compiler.cudagraph_mark_step_begin()
            return compiled(tok, start).clone()
        return compiled(tok, start)

    tok = torch.tensor([[11]], dtype=torch.int64, device=DEV)
    t0 = time.perf_counter()
    for i in range(3):  # compile and warm up
        tok = fn(tok, torch.tensor([PROMPT_LEN + i], device=DEV))
    torch.cuda.synchronize()
    warm_s = time.perf_counter() - t0
    starts = [torch.tensor([PROMPT_LEN + i], device=DEV) for i in range(STEPS)]
    runs = []
    for _ in range(3):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for s in starts:
            tok = fn(tok, s)
        torch.cuda.synchronize()
        runs.append((time.perf_counter() - t0) * 1e3 / STEPS)
    ms = statistics.median(runs)
    return {"mode": mode or "eager", "step_ms": round(ms, 4), "tok_per_s": round(1e3 / ms, 1),
            "runs_ms": [round(r, 4) for r in runs], "compile_and_warmup_s": round(warm_s, 1)}


def run(out_json: Path, arch: str, peers: list, runtime_flags: list[str], blocks: list[int], variant: str = "",
        profile: bool = False, traces: Path | None = None) -> dict:
    """Measure on the GPU and write OUT_JSON. peers: torch modes to run (None = eager), [] for none."""
    import iree.runtime as rt
    import torch

    if runtime_flags:  # before the driver is created
        rt.flags.parse_flags(*runtime_flags)
    result = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "prompt_tokens": PROMPT_LEN,
              "runtime_flags": runtime_flags, "variant": variant}
    result["copy"] = _copy_bandwidth(torch)
    print(f"copy bandwidth {result['copy']['tb_per_s']} TB/s", flush=True)
    target, drafter = _build(torch)
    embed = target.model.embed_tokens.weight
    tbytes = _bytes(target) - embed.numel() * embed.element_size()  # decode reads one embedding row
    lm = target.lm_head.weight
    dbytes = _bytes(drafter) + lm.numel() * lm.element_size()
    result["bytes"] = {"target_read_per_step": tbytes, "drafter_plus_lm_head": dbytes,
                       "draft_verify_bytes_ratio": round(dbytes / tbytes, 4)}
    keep: list = []
    t0 = time.perf_counter()
    indexes = _indexes(target, drafter, keep)
    result["host_copy_s"] = round(time.perf_counter() - t0, 1)
    print(f"weights: target reads {tbytes / 1e9:.2f} GB a step; host copies in {result['host_copy_s']} s", flush=True)
    device = rt.get_device("cuda")
    rows = -(-(PROMPT_LEN + STEPS + 3) // 32) * 32
    result["iree"] = {}
    for block in blocks:
        folder = artifact_dir(arch, block, variant)
        if not (folder / "manifest.json").is_file():
            print(f"skip {folder}: not compiled", flush=True)
            continue
        r = _iree_steps(folder, indexes, device, rows, profile, traces if block == blocks[0] else None)
        result["iree"][f"b{block}"] = r
        print(f"iree b{block}: decode {r['decode']['median_ms']:.3f} ms, verify {r['verify']['median_ms']:.3f} ms, "
              f"draft {r['draft']['median_ms']:.3f} ms (load {r['load_and_prefill_s']} s)", flush=True)
    del indexes, keep
    result["peers"] = []
    if peers:
        for mode in peers:
            try:
                r = _torch_decode(torch, target, mode, rows)
            except Exception as e:  # a peer that fails is reported, not fatal
                r = {"mode": mode or "eager", "error": f"{type(e).__name__}: {str(e)[:300]}"}
            result["peers"].append(r)
            print(f"torch {r['mode']}: {r.get('tok_per_s')} tok/s {r.get('error', '')}", flush=True)
    _derive(result)
    out_json.parent.mkdir(parents=True, exist_ok=True)
    out_json.write_text(json.dumps(result, indent=1) + "\n")
    print(format_table(result))
    return result


def _derive(r: dict) -> None:
    """Ratios and goal checks from the raw times (also run by `report`)."""
    b16 = r["iree"].get("b16")
    if not b16:
        return
    dec, ver, dra = (b16[k]["median_ms"] for k in ("decode", "verify", "draft"))
    copy = r["copy"]["tb_per_s"]
    achieved = r["bytes"]["target_read_per_step"] / (dec * 1e-3) / 1e12
    peers = {p["mode"]: p["tok_per_s"] for p in r["peers"] if "tok_per_s" in p}
    best_compile = max((v for k, v in peers.items() if k != "eager"), default=None)
    d = {
        "decode_tok_per_s": round(1e3 / dec, 1),
        "decode_tb_per_s": round(achieved, 3),
        "decode_fraction_of_copy": round(achieved / copy, 3),
        "verify_decode_ratio": round(ver / dec, 3),
        "draft_verify_ratio": round(dra / ver, 3),
        "draft_verify_goal": round(1.1 * r["bytes"]["draft_verify_bytes_ratio"], 3),
        "best_torch_compile_tok_per_s": best_compile,
    }
    if "b8" in r["iree"]:
        d["verify8_decode_ratio"] = round(r["iree"]["b8"]["verify"]["median_ms"] / dec, 3)
    if "decode_ahead" in b16:  # plain decoding as the runtime runs it (results before it lack it)
        ahead = b16["decode_ahead"]["median_ms"]
        achieved = r["bytes"]["target_read_per_step"] / (ahead * 1e-3) / 1e12
        d.update({"decode_ahead_tok_per_s": round(1e3 / ahead, 1), "decode_ahead_tb_per_s": round(achieved, 3),
                  "decode_ahead_fraction_of_copy": round(achieved / copy, 3),
                  "verify_decode_ahead_ratio": round(ver / ahead, 3)})
    r["derived"] = d
    r["verify_decode_ratio"] = d["verify_decode_ratio"]


def format_table(r: dict) -> str:
    """The markdown tables of docs/benchmarks.md."""
    if "derived" not in r:
        return "no IREE results"
    d, b16 = r["derived"], r["iree"]["b16"]
    lines = [f"{r['device']}, copy bandwidth {r['copy']['tb_per_s']:.2f} TB/s; target reads "
             f"{r['bytes']['target_read_per_step'] / 1e9:.2f} GB a step; after a {r['prompt_tokens']}-token prompt",
             "", "| step | median ms (p10..p90) | |", "|---|---|---|"]
    about = {"decode": "one synchronous call", "decode_ahead": "a token of plain decoding, one step ahead"}
    for name in ("decode", "decode_ahead", "verify", "draft", "round", "round_fused"):
        if name not in b16:
            continue
        s = b16[name]
        lines.append(f"| {name} (b16) | {s['median_ms']:.3f} ({s['p10_ms']:.3f}..{s['p90_ms']:.3f}) | "
                     f"{about.get(name, '')} |")
    if "b8" in r["iree"]:
        s = r["iree"]["b8"]["verify"]
        lines.append(f"| verify (b8) | {s['median_ms']:.3f} ({s['p10_ms']:.3f}..{s['p90_ms']:.3f}) | |")
    lines += ["", "| goal | measured | goal | met |", "|---|---|---|---|"]

    def row(name, value, goal, ok):
        lines.append(f"| {name} | {value} | {goal} | {'yes' if ok else 'no'} |")

    # plain decoding is what the runtime does (one step ahead, when measured) and what the torch
    # peers do (steps chained on the device); verify / decode compares synchronous calls
    pre = "decode_ahead_" if "decode_ahead_tok_per_s" in d else "decode_"
    how = " (one step ahead)" if pre == "decode_ahead_" else ""
    frac = d[pre + "fraction_of_copy"]
    row("plain decode bandwidth" + how, f"{d[pre + 'tb_per_s']:.2f} TB/s = {frac:.0%} of copy", ">= 70%", frac >= 0.7)
    if pre == "decode_ahead_":
        lines.append(f"| plain decode bandwidth, one synchronous call | {d['decode_tb_per_s']:.2f} TB/s = "
                     f"{d['decode_fraction_of_copy']:.0%} of copy | (reported) | |")
    best = d["best_torch_compile_tok_per_s"]
    if best:
        row("plain decode vs torch.compile" + how, f"{d[pre + 'tok_per_s']:.1f} vs {best:.1f} tok/s",
            ">= torch.compile", d[pre + "tok_per_s"] >= best)
    row("verify(16) / decode", f"{d['verify_decode_ratio']:.2f}", "<= 1.3", d["verify_decode_ratio"] <= 1.3)
    if "verify8_decode_ratio" in d:
        lines.append(f"| verify(8) / decode | {d['verify8_decode_ratio']:.2f} | (reported) | |")
    if "verify_decode_ahead_ratio" in d:
        lines.append(f"| verify(16) / decode one step ahead | {d['verify_decode_ahead_ratio']:.2f} | (reported) | |")
    row("draft / verify", f"{d['draft_verify_ratio']:.2f}", f"<= {d['draft_verify_goal']:.2f} (1.1 x bytes ratio "
        f"{r['bytes']['draft_verify_bytes_ratio']:.2f})", d["draft_verify_ratio"] <= d["draft_verify_goal"])
    if r["peers"]:
        lines += ["", "| plain decode, same weights | tok/s | step ms |", "|---|---|---|",
                  f"| IREE (ours, {b16['arch']}), synchronous calls | {d['decode_tok_per_s']:.1f} | "
                  f"{b16['decode']['median_ms']:.3f} |"]
        if "decode_ahead" in b16:
            lines.append(f"| IREE (ours, {b16['arch']}), one step ahead | {d['decode_ahead_tok_per_s']:.1f} | "
                         f"{b16['decode_ahead']['median_ms']:.3f} |")
        for p in r["peers"]:
            if "error" in p:
                lines.append(f"| torch {p['mode']} | failed: {p['error'][:80]} | |")
            else:
                lines.append(f"| torch {p['mode']} | {p['tok_per_s']:.1f} | {p['step_ms']:.3f} |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("prepare")
    p.add_argument("--arch", default="h200")
    p.add_argument("--blocks", type=int, nargs="+", default=[16, 8])
    p.add_argument("--variant", default="", help="build into .gpu/8b-b{block}{variant}-{arch}")
    p.add_argument("--without", nargs="+", default=[], choices=WITHOUT,
                   help="leave these splice options out (a variant: needs --variant)")
    r = sub.add_parser("run")
    r.add_argument("--json", default=str(WORK / "speed_8b.json"))
    r.add_argument("--arch", default="sm_80")
    r.add_argument("--no-peers", action="store_true")
    r.add_argument("--peers", nargs="+", default=["eager", "default", "reduce-overhead"],
                   help="torch peers: eager and torch.compile modes")
    r.add_argument("--blocks", type=int, nargs="+", default=[16, 8])
    r.add_argument("--variant", default="", help="artifact folders .gpu/8b-b{block}{variant}-{arch} (a compile experiment)")
    r.add_argument("--profile", action="store_true",
                   help="kernel times of each step, and the host's timeline of decode and verify (CUPTI, torch.profiler)")
    r.add_argument("--traces", help="with --profile: write one step's chrome trace of decode and verify here")
    r.add_argument("--runtime-flag", action="append", default=[], dest="runtime_flags",
                   help="an iree.runtime driver flag, repeatable; write --runtime-flag=--cuda_use_streams=false")
    q = sub.add_parser("report")
    q.add_argument("json")
    args = ap.parse_args()
    if args.cmd == "prepare":
        if args.without and not args.variant:
            ap.error("--without builds a variant: give it a --variant name")
        prepare(args.arch, args.blocks, args.variant, tuple(args.without))
    elif args.cmd == "run":
        peers = [] if args.no_peers else [None if m == "eager" else m for m in args.peers]
        run(Path(args.json), args.arch, peers, args.runtime_flags, args.blocks, args.variant, args.profile,
            Path(args.traces) if args.traces else None)
    else:
        r = json.loads(Path(args.json).read_text())
        _derive(r)
        print(format_table(r))
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", "/tmp/inductor")
    sys.exit(main())
