"""What the bench scripts share: their command line (prepare here, run on the GPU machine, report
here), writing a result, wall-clock timing, the copy bandwidth, and CUPTI's view of the kernels and
of the host's launches (through torch.profiler, which records the kernels IREE launches in the same
process too).

A script runs `prepare` here (the `compile` extra: torch, the IREE compiler), `run` on the GPU
machine from the installed wheels (bench/on_device.sh; iree.runtime, numpy, torch with CUDA), and
`report` here on the JSON that `run` wrote. Scripts import this as `common` (their own folder is
the first entry of sys.path when Python runs them).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

from dflash_iree.runtime.speed_report import timeline_rows

ROOT = Path(__file__).resolve().parents[1]
WORK = ROOT / ".gpu"  # git-ignored: what prepare writes and run reads (carried as .gpu/artifacts.zip)


def main(doc: str, commands: dict[str, tuple[Callable, Callable | None]], argv: list[str] | None = None) -> int:
    """The script's command line: one subcommand per entry of `commands`.

    Args:
        doc: the script's docstring (its first paragraph is the description, the rest the epilog).
        commands: name -> (run, options): options(parser) adds the subcommand's arguments (None:
            none), run(args) does it and returns an exit status (None: 0).

    A DFlashError raised by a command (bad input) is one line on stderr and exit status 2.
    """
    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0], epilog="\n\n".join(doc.split("\n\n")[1:]),
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    for name, (run, options) in commands.items():
        p = sub.add_parser(name)
        if options:
            options(p)
        p.set_defaults(run=run)
    args = ap.parse_args(argv)
    from dflash_iree.errors import DFlashError

    try:
        return args.run(args) or 0
    except DFlashError as e:  # bad input: one line, exit status 2 (the project's rule)
        print(f"{Path(sys.argv[0]).name}: {e}", file=sys.stderr)
        return 2


def write_json(path: str | Path, result: dict) -> None:
    """`result` as indented JSON at `path`, its folder made when missing."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1) + "\n")


def times(fn, n: int, warmup: int = 3) -> list[float]:
    """Wall ms of `n` calls of fn() after `warmup` calls; fn must return only when its work is done."""
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t0) * 1e3)
    return out


def summary(ms: list[float]) -> dict:
    q = statistics.quantiles(ms, n=10)
    return {"median_ms": round(statistics.median(ms), 4), "p10_ms": round(q[0], 4), "p90_ms": round(q[-1], 4),
            "n": len(ms)}


def copy_bandwidth(nbytes: int = 4 * 2**30) -> dict:
    """A device-to-device copy of `nbytes` (torch, CUDA): wall ms of 20 copies (`summary`) and
    tb_per_s = 2 x bytes (read + written) / median time, in TB/s."""
    import torch

    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)

    def copy():
        dst.copy_(src)
        torch.cuda.synchronize()

    s = summary(times(copy, 20))
    del src, dst
    torch.cuda.empty_cache()
    return {**s, "bytes": nbytes, "tb_per_s": round(2 * nbytes / (s["median_ms"] * 1e-3) / 1e12, 3),
            "gpu": torch.cuda.get_device_name(0)}


def cuda_profile(fn, wall_ms: float, n: int = 10, top: int = 25, per: int = 1) -> dict:
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


def trace_events(fn, n: int) -> list:
    """The complete ("X") events of a chrome trace of n calls of fn() after one unprofiled call
    (torch.profiler, host and CUDA activity), each call inside a "dflash_step" range."""
    import tempfile

    from torch.profiler import ProfilerActivity, profile, record_function

    fn()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            with record_function("dflash_step"):
                fn()
    with tempfile.TemporaryDirectory() as tmp:
        prof.export_chrome_trace(f"{tmp}/t.json")
        return [e for e in json.loads(Path(f"{tmp}/t.json").read_text())["traceEvents"] if e.get("ph") == "X"]


def host_timeline(fn, n: int = 8, trace: Path | None = None) -> dict:
    """Where the host's time of a step goes, from CUPTI's driver-API records (torch.profiler): each
    `cuLaunchKernel` IREE makes, with its host start and duration, joined to the kernel it launched.
    Per step (medians over n calls of fn()), in µs from the step's start: the first and last launch,
    the launches and the time inside them, the other driver calls by name, the time between one
    launch's end and the next one's start (the VM and HAL's own work per dispatch), when the GPU
    starts and ends, its busy time, and its idle time while it waits for a launch (a gap before a
    kernel whose launch ended after the kernel before it finished). `trace`: also write the first
    profiled step's chrome trace there."""
    events = trace_events(fn, n)
    steps, driver, rows = timeline_rows(events)
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
