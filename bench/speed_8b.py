"""Qwen3-8B-shaped speed on a GPU: decode, verify and draft steps against bandwidth and PyTorch peers.

    python bench/speed_8b.py prepare [--arch h200]          # here: compile the 8B pair (block 16, and block 8)
    python bench/speed_8b.py prepare --blocks 8 --variant att --without epilogues   # a variant beside it
    bash bench/on_device.sh python3 bench/speed_8b.py run --json OUT   # on the GPU machine (torch with CUDA)
    python bench/speed_8b.py report OUT                     # here: the table of docs/benchmarks.md
    ... run --blocks 16 --against pre --rounds 3            # this build and .gpu/8b-b16pre-*, alternated in one process

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
  take the most time (and a timed prefill's, when one is asked for, as bench/speed_27b.py does); and
  the host's timeline of decode and verify (common.host_timeline: when
  the first and last `cuLaunchKernel` come, when the GPU starts and ends, its idle time), for calls
  as the runtime makes them and for plain decoding's steps in a row;
- achieved bandwidth of decode = the target's weight bytes read per step (every parameter but the
  embedding table) x steps per second;
- peers on the same weights: the same `Qwen3` module in PyTorch eager, and under `torch.compile`
  (default mode, and "reduce-overhead", which adds CUDA graphs), 64 decode steps chained on the device,
  attending over the same number of cache rows.

Ratios, goals and tables: runtime/speed_report.py (the goals of issues 7 and 8). The host time of a
bare invocation (`issue`, the `*_invoke` timelines) was an experiment's (experiments/LOG.md,
2026-12-01 host-timeline): `git show ff3b5e2:bench/speed_8b.py` has it.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from pathlib import Path

from common import ROOT, WORK, copy_bandwidth, cuda_profile, host_timeline, main, summary, times, write_json

from dflash_iree.runtime.speed_report import derive, format_table

TARGET = ROOT / "tests" / "fixtures" / "qwen3-8b"
DRAFTER = ROOT / "tests" / "fixtures" / "qwen3-8b-dflash-b16"
PROMPT_LEN = 512
MAX_CONTEXT = 1024  # the torch peers' cache: the steps never reach past it
STEPS = 64
DEV = "cuda"


def artifact_dir(arch: str, block: int, variant: str = "") -> Path:
    return WORK / f"8b-b{block}{variant}-{arch}"


# What `prepare --without` can leave out, for a variant measured beside the full build.
WITHOUT = ("epilogues", "decode-qkv", "norm-rope-pairs", "row-invariant", "decode-steps")


def prepare(arch: str, blocks: list[int], variant: str = "", without: tuple[str, ...] = (),
            decode_steps: int | None = None) -> None:
    """Compile the 8B pair as `make compile` does (max_context 4096) for `arch` at each block size into
    .gpu/ (git-ignored; carry it). WITHOUT (with a VARIANT name): "epilogues", o_proj, down_proj and
    gate/up with their elementwise ops on IREE's matmuls (the linears with an epilogue); "decode-qkv",
    decode's q, k and v as IREE's three matvecs; "norm-rope-pairs", q's and k's norm + rope as two
    dispatches (the drafter's: the target's take the KV-writing op, one dispatch, either way); "row-invariant", the lowerings before row invariance (decode's lone weights, gate/up and
    attention on IREE's ops, the 4 MiB weight floor: bench/row_invariance_check.py's "before" build);
    "decode-steps", no `decode_steps` entry point (one plain step a call). decode_steps: k of that
    entry point in place of the arch's (a variant: needs VARIANT)."""
    import functools

    from dflash_iree.export import splice
    from dflash_iree.export.compile import compile_artifacts, resolve_arch

    splices = splice.before_row_invariance() if "row-invariant" in without else dict(splice.LOWERINGS)
    if {"epilogues", "decode-qkv"} & set(without):
        splices["gemm"] = functools.partial(splices["gemm"], epilogues="epilogues" not in without,
                                            decode_qkv="decode-qkv" not in without)
    if "norm-rope-pairs" in without:
        splices["norm_rope"] = functools.partial(splice.lower_norm_rope, pairs=False)
    name = resolve_arch(arch)[0].name
    for block in blocks:
        compile_artifacts(arch, TARGET, DRAFTER, artifact_dir(name, block, variant), block_size=block, dtype="bf16",
                          splices=splices if without else None,
                          decode_steps=0 if "decode-steps" in without else decode_steps)


# ---------------------------------------------------------------- on the GPU


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


def _iree_steps(folder: Path, indexes: dict, device, rows: int, profile: bool = False,
                traces: Path | None = None, prefill_len: int = 0, profile_top: int = 25) -> dict:
    """decode / verify / draft step times of one compiled artifact, after a PROMPT_LEN prefill.

    prefill_len: > 0 also times a prefill of that many tokens (ms and tok/s, 3 runs after one warm-up).
    profile_top: kernels kept per step's profile (`cuda_profile`'s top)."""
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

    if prefill_len:
        long_prompt = [(11 * i + 5) % 1000 + 10 for i in range(prefill_len)]
        ms = times(lambda: pair.prefill(long_prompt), 3, warmup=1)
        out["prefill"] = {"tokens": prefill_len, **summary(ms),
                          "tok_per_s": round(prefill_len / statistics.median(ms) * 1e3, 1)}
        first, taps = pair.prefill(prompt)  # back to the PROMPT_LEN context the steps below assume
        pair.absorb(taps)
    start = PROMPT_LEN
    state = {"tok": first, "pos": start}

    def decode():
        state["tok"] = pair.decode(state["tok"], state["pos"])
        state["pos"] += 1

    out["decode"] = summary(times(decode, STEPS))

    # Two token checks that decode again from `start` after the timed steps moved past it: a KV cache
    # rolls back by length; a hybrid target's recurrent state only within its last call's rows
    # (export/recurrent_state.py), so for one the prompt is prefilled again before each check.
    hybrid = "recurrent" in m.state

    def rewind():
        if hybrid:
            pair.prefill(prompt)

    rewind()
    tok, ref = first, []
    for i in range(16):
        tok = pair.decode(tok, start + i)
        ref.append(tok)
    rewind()
    out["decode_tokens"] = ref  # two builds of one export on the same weights: equal where they compute the same tokens
    out["decode_ahead_same_tokens"] = list(pair.decode_ahead(first, start, 16)) == ref
    # verify over decode's own tokens must pick them again, except at a bf16 near-tie: a check of the
    # verify graph's custom dispatches (GEMMs and their epilogues, block attention) against decode's
    rewind()
    picked, _ = pair.verify([first] + ref[:B - 1], start)
    out["verify_agrees_with_decode"] = f"{sum(a == b for a, b in zip(picked, ref[:B]))}/{B}"
    rewind()

    def ahead():  # the runtime's plain decoding: STEPS tokens from the same position each time
        for _ in pair.decode_ahead(first, start, STEPS):
            pass

    out["decode_ahead"] = summary([ms / STEPS for ms in times(ahead, 8, warmup=1)])
    block = [first] + [11 + i for i in range(B - 1)]
    verify_taps = {}

    def verify():
        _, verify_taps["t"] = pair.verify(block, start)  # the same block again: rollback by length

    out["verify"] = summary(times(verify, 32))

    def draft():
        pair.draft(verify_taps["t"], start, B, block[-1], start + B)

    out["draft"] = summary(times(draft, 32))

    def round_():
        draft()
        verify()

    out["round"] = summary(times(round_, 32))
    steps = {"decode": decode, "decode_ahead": ahead, "verify": verify, "draft": draft}
    if pair.has_verify_draft():
        def fused():
            pair.verify_draft(block, start)

        out["round_fused"] = summary(times(fused, 32))
        steps["verify_draft"] = fused
    if profile:
        walls = {name: out[name]["median_ms"] for name in steps if name in out}
        walls["verify_draft"] = out.get("round_fused", {}).get("median_ms")
        out["profile"] = {name: cuda_profile(fn, walls[name], *((2, profile_top, STEPS) if name == "decode_ahead"
                                                                else (10, profile_top)))
                          for name, fn in steps.items()}  # decode_ahead: per token, over 2 x STEPS
        out["host_timeline"] = {
            name: host_timeline(steps[name], trace=traces / f"trace_{folder.name}_{name}.json" if traces else None)
            for name in ("decode", "verify")}

        def ahead16():  # plain decoding's steps in a row
            for _ in pair.decode_ahead(first, start, 16):
                pass

        out["host_timeline"]["decode_ahead_16"] = host_timeline(ahead16, n=4)
        if prefill_len:  # last: it leaves the long prompt's context behind
            out["profile"]["prefill"] = cuda_profile(lambda: pair.prefill(long_prompt), out["prefill"]["median_ms"], 1,
                                                     profile_top)
    out["decode_cache_rows"] = rows
    del pair
    return out


def _torch_decode(torch, target, mode: str | None, rows: int, profile: bool = False) -> dict:
    """tok/s of 64 chained greedy decode steps of our Qwen3 module, eager or torch.compile(mode);
    with profile, its kernel times a step too (CUPTI, `cuda_profile`)."""
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
    out = {"mode": mode or "eager", "step_ms": round(ms, 4), "tok_per_s": round(1e3 / ms, 1),
           "runs_ms": [round(r, 4) for r in runs], "compile_and_warmup_s": round(warm_s, 1)}
    if profile:
        box = [tok]

        def step_once():
            box[0] = fn(box[0], starts[0])

        out["profile"] = cuda_profile(step_once, round(ms, 4), 16, 25)
    return out


def run(out_json: Path, arch: str, peers: list, runtime_flags: list[str], blocks: list[int], variant: str = "",
        profile: bool = False, traces: Path | None = None, against: str | None = None, rounds: int = 3) -> dict:
    """Measure on the GPU and write OUT_JSON. peers: torch modes to run (None = eager), [] for none.
    against: another build's variant name, measured beside this one (`_alternate`)."""
    import iree.runtime as rt
    import torch

    if runtime_flags:  # before the driver is created
        rt.flags.parse_flags(*runtime_flags)
    result = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "prompt_tokens": PROMPT_LEN,
              "runtime_flags": runtime_flags, "variant": variant}
    result["copy"] = copy_bandwidth()
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
    if against:
        result["alternated"] = _alternate(arch, blocks[0], [variant, against], rounds, indexes, device, rows)
    del indexes, keep
    result["peers"] = []
    if peers:
        for mode in peers:
            try:
                r = _torch_decode(torch, target, mode, rows, profile)
            except Exception as e:  # a peer that fails is reported, not fatal
                r = {"mode": mode or "eager", "error": f"{type(e).__name__}: {str(e)[:300]}"}
            result["peers"].append(r)
            print(f"torch {r['mode']}: {r.get('tok_per_s')} tok/s {r.get('error', '')}", flush=True)
    derive(result)
    write_json(out_json, result)
    print(format_table(result))
    return result


ALTERNATED = ("decode", "decode_ahead", "verify", "draft", "round_fused")


def _alternate(arch: str, block: int, variants: list[str], rounds: int, indexes, device, rows: int) -> dict:
    """Two builds side by side in this one process: each variant's steps measured in turn, `rounds`
    times; per variant and step the median of each round's median (ms), and the ratio of the first
    variant to the second (this build over the one it is compared with); and each variant's 16 decoded
    tokens from the same start (equal where the two builds compute the same tokens)."""
    runs: dict = {v: {k: [] for k in ALTERNATED} for v in variants}
    tokens: dict = {}
    for i in range(rounds):
        for v in variants:
            r = _iree_steps(artifact_dir(arch, block, v), indexes, device, rows)
            tokens.setdefault(v, r["decode_tokens"])
            for k in ALTERNATED:
                if k in r:
                    runs[v][k].append(r[k]["median_ms"])
            print(f"round {i + 1} {v or 'this build'}: " + ", ".join(f"{k} {runs[v][k][-1]:.3f}" for k in ALTERNATED
                                                              if runs[v][k]), flush=True)
    med = {v: {k: statistics.median(ms) for k, ms in steps.items() if ms} for v, steps in runs.items()}
    a, b = variants
    print(f"decode tokens, {a or 'this build'} == {b}: {tokens[a] == tokens[b]}", flush=True)
    return {"variants": variants, "rounds": rounds, "block": block, "runs_ms": runs, "median_ms": med,
            "ratio": {k: round(med[a][k] / med[b][k], 4) for k in med[a] if k in med[b]},
            "decode_tokens": tokens, "same_decode_tokens": tokens[a] == tokens[b]}


def _prepare_options(p) -> None:
    p.add_argument("--arch", default="h200")
    p.add_argument("--blocks", type=int, nargs="+", default=[16, 8])
    p.add_argument("--variant", default="", help="build into .gpu/8b-b{block}{variant}-{arch}")
    p.add_argument("--without", nargs="+", default=[], choices=WITHOUT,
                   help="leave these splice options out (a variant: needs --variant)")
    p.add_argument("--decode-steps", type=int, help="k of the decode_steps entry point in place of the arch's "
                   "(a variant: needs --variant)")


def _run_options(r) -> None:
    r.add_argument("--json", default=str(WORK / "speed_8b.json"))
    r.add_argument("--arch", default="sm_80")
    r.add_argument("--no-peers", action="store_true")
    r.add_argument("--peers", nargs="+", default=["eager", "default", "reduce-overhead"],
                   help="torch peers: eager and torch.compile modes")
    r.add_argument("--blocks", type=int, nargs="+", default=[16, 8])
    r.add_argument("--variant", default="", help="artifact folders .gpu/8b-b{block}{variant}-{arch} (a compile experiment)")
    r.add_argument("--against", help="another build's --variant, measured beside this one, alternated")
    r.add_argument("--rounds", type=int, default=3, help="with --against: times each build is measured in turn")
    r.add_argument("--profile", action="store_true",
                   help="kernel times of each step, and the host's timeline of decode and verify (CUPTI, torch.profiler)")
    r.add_argument("--traces", help="with --profile: write one step's chrome trace of decode and verify here")
    r.add_argument("--runtime-flag", action="append", default=[], dest="runtime_flags",
                   help="an iree.runtime driver flag, repeatable; write --runtime-flag=--cuda_use_streams=false")


def _prepare(args) -> None:
    if (args.without or args.decode_steps is not None) and not args.variant:
        raise SystemExit("--without and --decode-steps build a variant: give it a --variant name")
    prepare(args.arch, args.blocks, args.variant, tuple(args.without), args.decode_steps)


def _run(args) -> None:
    peers = [] if args.no_peers else [None if m == "eager" else m for m in args.peers]
    run(Path(args.json), args.arch, peers, args.runtime_flags, args.blocks, args.variant, args.profile,
        Path(args.traces) if args.traces else None, args.against, args.rounds)


def _report(args) -> None:
    r = json.loads(Path(args.json).read_text())
    derive(r)
    print(format_table(r))


if __name__ == "__main__":
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", "/tmp/inductor")
    sys.exit(main(__doc__, {"prepare": (_prepare, _prepare_options), "run": (_run, _run_options),
                            "report": (_report, lambda q: q.add_argument("json"))}))
