"""Two drafters' draft steps at one shape, each as a fraction of the target's verify, on a GPU.

    # here: compile both pairs from their configs (weight-free), keeping the sm_80 artifacts
    python bench/compile_from_config.py --target tests/fixtures/qwen3.5-27b \\
        --drafter tests/fixtures/qwen3.6-27b-dflash2 --archs sm_80 --keep .gpu/27b-d2
    python bench/compile_from_config.py --target tests/fixtures/qwen3.5-27b \\
        --drafter tests/fixtures/qwen3.6-27b-dflash-v1 --archs sm_80 --keep .gpu/27b-v1
    # on the GPU machine (bench/on_device.sh), then here
    bash bench/on_device.sh python3 bench/draft_step.py run --artifacts 27b-d2-sm_80 27b-v1-sm_80 --json OUT
    python bench/draft_step.py report OUT

This is issue 27's side-by-side: the DFlash2 drafter of the Qwen3.6-27B example
(tests/fixtures/qwen3.6-27b-dflash2) and a DFlash v1 drafter of the same shape
(tests/fixtures/qwen3.6-27b-dflash-v1), both with the Qwen3.5-27B target. No checkpoint travels:
`run` builds the target and the drafters from the artifacts' recorded configs on the GPU with the
modules' own random bf16 initialization (non-finite values zeroed), copies them to host memory once,
and binds the same target tensors into every artifact (`iree.runtime.ParameterIndex.add_buffer`).
Each artifact's module uploads its own device copy of them: two 27B artifacts need about 2 x 56 GB,
so that run fits an H200 and not an 80 GB H100 (it stopped there out of device memory at the
second bind).

After a PROMPT_LEN prefill, in one process and alternated ROUNDS times over the artifacts: verify
(block_size rows), draft (the drafter's whole step: absorb of the verified rows, its forward, and
for DFlash2 the top-K and the selector's walk) and a round (draft, then verify), each a synchronous
call as the runtime makes it. Then CUPTI's kernel times of each draft step (bench/common.py
`cuda_profile`), which name the top-K dispatch, and of the first artifact's verify and of a plain
decode step (the target's own: every artifact holds the same target). For a drafter with a top-K
dispatch in its draft step (DFlash2's selector), also the selector's share of the step from the
CUDA timeline (`_selector_span`).
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

from common import WORK, cuda_profile, main, summary, times, trace_events, write_json

PROMPT_LEN = 512
ROUNDS = 3
DEV = "cuda"


def _modules(torch, arts, dev: str, with_target: bool):
    """(target or None, drafter) of one artifact on `dev`, random, in the artifact's dtype, built
    as export/aot.py `build_pair` builds them on the meta device for the compile."""
    from dflash_iree.config import load_drafter_config, load_target_config
    from dflash_iree.config_qwen35 import HybridConfig
    from dflash_iree.export.dflash2 import drafter_class
    from dflash_iree.export.qwen35 import Qwen35
    from dflash_iree.export.qwen3 import Qwen3

    m = arts.manifest
    tcfg = load_target_config(arts.recorded_folder("target"))
    dcfg = load_drafter_config(arts.recorded_folder("drafter"), tcfg)
    B, C, attention = arts.block_size, arts.max_context, m.attention
    dtype = {"bf16": torch.bfloat16, "f16": torch.float16, "f32": torch.float32}[m.dtype]
    target = None
    with torch.device(dev):
        if with_target and isinstance(tcfg, HybridConfig):
            target = Qwen35(tcfg, C, dcfg.target_layer_ids, 1, dtype, attention=attention, state_slots=B)
        elif with_target:
            target = Qwen3(tcfg, C, dcfg.target_layer_ids, 1, dtype, attention=attention)
        drafter = drafter_class(dcfg)(dcfg, C, B, 1, dtype, attention=attention)
    if dcfg.dflash2 is not None:
        drafter.candidate_selector.op_top_k = max(dcfg.dflash2.selector_top_k, m.draft_top_k)
    return target, drafter


def _host_index(torch, module, keep: list):
    """A ParameterIndex of host copies of the module's GPU tensors (kept alive in `keep`)."""
    import iree.runtime as rt

    index = rt.ParameterIndex()
    nbytes = 0
    for key, p in module.named_parameters():
        with torch.no_grad():
            if p.is_floating_point():
                p.nan_to_num_(0.0, 0.0, 0.0)
        host = p.detach().view(torch.int16).cpu().numpy() if p.dtype == torch.bfloat16 else p.detach().cpu().numpy()
        keep.append(host)
        index.add_buffer(key, host)
        nbytes += host.nbytes
    return index, nbytes


def _steps(pair, B: int, prompt_len: int, vocab: int) -> dict:
    """The step callables of one bound pair, after a prompt_len prefill."""
    prompt = [((7 * i + 3) % 1000 + 10) % vocab for i in range(prompt_len)]
    first, taps = pair.prefill(prompt)
    pair.absorb(taps)
    start = prompt_len
    block = [first] + [(11 + i) % vocab for i in range(B - 1)]
    state = {}

    def verify():
        _, state["taps"] = pair.verify(block, start)  # the same block again: rollback by length

    verify()

    def draft():
        pair.draft(state["taps"], start, B, block[-1], start + B)

    def round_():
        draft()
        verify()

    pos = {"tok": first, "at": start}

    def decode():  # plain decoding's step; the position walks on (the cache has room for it)
        pos["tok"] = pair.decode(pos["tok"], pos["at"])
        pos["at"] += 1

    return {"verify": verify, "draft": draft, "round": round_, "decode": decode}


def _selector_span(fn, n: int = 10) -> dict | None:
    """How much of a draft step its tail from the first top-K kernel on takes: the top-16, the
    selector's walk and whatever the step does after them (DFlash2's draft step ends with the walk).
    Medians over n profiled calls (torch.profiler, host and CUDA activity), in µs: the step's wall
    time, from the first top-K kernel's start to the step's return (`tail_us`, what the step would
    lose without them, launch gaps included) and to the last kernel's end (`tail_gpu_us`), and the
    kernels in that tail. None when the step launches no top-K kernel."""
    events = trace_events(fn, n)
    launched = {e["args"]["correlation"]: e for e in events if e.get("cat") == "cuda_driver"
                and e["name"].startswith("cuLaunch") and "correlation" in e.get("args", {})}
    kernels = [e for e in events if e.get("cat") == "kernel" and e.get("args", {}).get("correlation") in launched]
    rows = []
    for st in (e for e in events if e["name"] == "dflash_step"):
        t0, t1 = st["ts"], st["ts"] + st["dur"]
        mine = sorted((k for k in kernels if t0 <= launched[k["args"]["correlation"]]["ts"] <= t1), key=lambda k: k["ts"])
        first = next((i for i, k in enumerate(mine) if "topk" in k["name"].lower()), None)
        if first is None:
            return None
        tail = mine[first:]
        rows.append((st["dur"], t1 - tail[0]["ts"], max(k["ts"] + k["dur"] for k in tail) - tail[0]["ts"], len(tail),
                     sum(k["dur"] for k in tail)))
    med = [statistics.median(r[i] for r in rows) for i in range(5)]
    return {"step_us": round(med[0], 1), "tail_us": round(med[1], 1), "tail_gpu_us": round(med[2], 1),
            "tail_kernels": med[3], "tail_busy_us": round(med[4], 1), "tail_of_step": round(med[1] / med[0], 4)}


def _run(args) -> int:
    import iree.runtime as rt  # noqa: F401
    import torch

    from dflash_iree.runtime.artifacts import Artifacts, open_device

    folders = [WORK / name for name in args.artifacts]
    arts = [Artifacts.load(f) for f in folders]
    if any(a.manifest.target["config"] != arts[0].manifest.target["config"] for a in arts):
        sys.exit(f"--artifacts {' '.join(args.artifacts)}: their targets differ; compare drafters of one target")
    torch.manual_seed(0)
    gpu = torch.cuda.get_device_name(0) if args.device == "cuda" else "host CPU"
    keep, indexes, out = [], [], {"artifacts": {}, "gpu": gpu, "prompt_len": args.prompt_len}
    target_index = None
    t0 = time.perf_counter()
    for a in arts:
        target, drafter = _modules(torch, a, args.device, with_target=target_index is None)
        if target is not None:  # every artifact binds the same target tensors
            target_index, tbytes = _host_index(torch, target, keep)
            out["target_weight_gb"] = round(tbytes / 1e9, 2)
        drafter_index, dbytes = _host_index(torch, drafter, keep)
        indexes.append({"target": target_index, "drafter": drafter_index})
        out["artifacts"][a.vmfb.parent.name] = {"drafter_weight_gb": round(dbytes / 1e9, 3),
                                               "dispatches_per_call": a.manifest.stats["dispatches_per_call"],
                                               "block_size": a.block_size}
        del target, drafter
        if args.device == "cuda":
            torch.cuda.empty_cache()
    out["build_s"] = round(time.perf_counter() - t0, 1)
    device = open_device(arts[0])
    pairs, steps = [], []
    for a, index in zip(arts, indexes):
        t0 = time.perf_counter()
        pair = a.bind_indexes(device, index)
        s = _steps(pair, a.block_size, args.prompt_len, a.manifest.target["config"]["vocab_size"])
        pairs.append(pair)
        steps.append(s)
        out["artifacts"][a.vmfb.parent.name]["bind_and_prefill_s"] = round(time.perf_counter() - t0, 1)
        print(f"{a.vmfb.parent.name}: bound and prefilled in {time.perf_counter() - t0:.1f} s", flush=True)
    ms = {a.vmfb.parent.name: {k: [] for k in ("verify", "draft", "round")} for a in arts}
    for _ in range(args.rounds):
        for a, s in zip(arts, steps):
            for k in ("verify", "draft", "round"):
                ms[a.vmfb.parent.name][k] += times(s[k], args.n)
    for a, s in zip(arts, steps):
        name = a.vmfb.parent.name
        rec = out["artifacts"][name]
        rec.update({k: summary(v) for k, v in ms[name].items()})
        rec["draft_over_verify"] = round(rec["draft"]["median_ms"] / rec["verify"]["median_ms"], 4)
        if args.device == "cuda":
            rec["draft_profile"] = cuda_profile(s["draft"], rec["draft"]["median_ms"], top=40)
            try:  # the table must not be lost to the trace's parsing
                rec["selector_span"] = _selector_span(s["draft"])
            except Exception as e:  # noqa: BLE001
                rec["selector_span_error"] = repr(e)[:300]
        print(f"{name}: verify {rec['verify']['median_ms']:.3f} ms, draft {rec['draft']['median_ms']:.3f} ms "
              f"({rec['draft_over_verify']:.3f} of verify), round {rec['round']['median_ms']:.3f} ms", flush=True)
    first, s = arts[0].vmfb.parent.name, steps[0]  # the target's own steps (every artifact has the same)
    rec = out["artifacts"][first]
    rec["decode"] = summary(times(s["decode"], args.n))
    if args.device == "cuda":
        rec["verify_profile"] = cuda_profile(s["verify"], rec["verify"]["median_ms"], top=40)
        rec["decode_profile"] = cuda_profile(s["decode"], rec["decode"]["median_ms"], top=40)
    print(f"{first}: decode {rec['decode']['median_ms']:.3f} ms", flush=True)
    write_json(args.json, out)
    return 0


def _run_options(p) -> None:
    p.add_argument("--artifacts", nargs="+", required=True, help="folders under .gpu/ (the first drafter is "
                   "compared with the others)")
    p.add_argument("--json", required=True)
    p.add_argument("--rounds", type=int, default=ROUNDS)
    p.add_argument("--prompt-len", type=int, default=PROMPT_LEN)
    p.add_argument("--n", type=int, default=20, help="calls a step per round")
    p.add_argument("--device", default=DEV, help="torch's device for the random weights: cuda, or cpu for a "
                   "host artifact (a smoke run: no kernel profile)")


def _report(args) -> int:
    import json

    r = json.loads(Path(args.json[0]).read_text())
    for more in args.json[1:]:  # runs of one artifact each (one 27B artifact a process fits 80 GB)
        r["artifacts"].update(json.loads(Path(more).read_text())["artifacts"])
    names = list(r["artifacts"])
    print(f"{r['gpu']}, after a {r['prompt_len']}-token prefill; target {r['target_weight_gb']} GB of weights\n")
    print("| artifact | drafter GB | verify ms | draft ms | draft / verify | round ms | draft dispatches |")
    print("|---|---|---|---|---|---|---|")
    for n in names:
        a = r["artifacts"][n]
        print(f"| {n} | {a['drafter_weight_gb']} | {a['verify']['median_ms']:.3f} | {a['draft']['median_ms']:.3f} | "
              f"{a['draft_over_verify']:.3f} | {a['round']['median_ms']:.3f} | {a['dispatches_per_call'].get('draft')} |")
    base, other = r["artifacts"][names[0]], [r["artifacts"][n] for n in names[1:]]
    if "decode" in base:
        print(f"\nplain decode step {base['decode']['median_ms']:.3f} ms; verify / decode "
              f"{base['verify']['median_ms'] / base['decode']['median_ms']:.2f}")
    for n, o in zip(names[1:], other):
        extra = base["draft"]["median_ms"] - o["draft"]["median_ms"]
        print(f"\n{names[0]} draft - {n} draft = {extra:.3f} ms = {extra / base['draft']['median_ms']:.3f} of "
              f"{names[0]}'s draft step")
    for n in names:
        span = r["artifacts"][n].get("selector_span")
        if span:
            print(f"\n{n}: from the first top-K kernel to the step's return {span['tail_us']:.1f} us of a "
                  f"{span['step_us']:.1f} us profiled step ({span['tail_of_step']:.3f}); {span['tail_kernels']:.0f} "
                  f"kernels, {span['tail_busy_us']:.1f} us busy, {span['tail_gpu_us']:.1f} us on the GPU's timeline")
    topk = [k for k in base.get("draft_profile", {"top": []})["top"] if "topk" in k["kernel"].lower()]
    for k in topk:
        print(f"top-K kernel {k['kernel'][:60]}: {k['ms']:.4f} ms a draft step "
              f"({k['ms'] / base['draft']['median_ms']:.3f} of it)")
    return 0


if __name__ == "__main__":
    sys.exit(main(__doc__, {"run": (_run, _run_options),
                            "report": (_report, lambda p: p.add_argument("json", nargs="+", help="one run's JSON, or "
                                                          "several runs' of one artifact each (merged)"))}))
