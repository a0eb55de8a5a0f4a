"""The report of the GPU speed benchmark (bench/speed_8b.py): ratios and goal checks from its
result JSON, the markdown tables of docs/benchmarks.md, and a step's host timeline from a CUPTI
chrome trace. Plain Python on the JSON (no IREE, no torch), so committed results can be derived
again anywhere (tests/test_speed_8b.py does).

Goals (issues 7 and 8): decode >= 70% of copy bandwidth and not slower than torch.compile;
verify/decode <= 1.3; draft/verify <= 1.1 x (drafter bytes + lm_head bytes) / target bytes.
"""

from __future__ import annotations

import statistics


def derive(r: dict) -> None:
    """Add r["derived"]: the ratios and goal checks from a bench/speed_8b.py result's raw times
    (median ms of each step, copy bandwidth in TB/s, bytes a step), and r["verify_decode_ratio"].
    Tok/s, TB/s and fractions of copy bandwidth from the block-16 artifact ("b16"); verify(8) / decode
    when a block-8 artifact ran; the one-step-ahead figures when the result has `decode_ahead`. A
    result without "b16" is left as it is."""
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
    """The markdown tables of docs/benchmarks.md from a result `derive` has run on: the steps' median ms
    (p10..p90), the goals measured and met, and the plain-decoding peers."""
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


def timeline_rows(events: list) -> tuple[list, list, list]:
    """Per-step rows of a host timeline from a chrome trace's complete ("X") events (torch.profiler
    with CUPTI): each step is a "dflash_step" range; the CUDA driver calls in it are joined to the GPU
    ops they launched by correlation id.

    Returns:
        (the steps, the driver calls, one row per step with a launch: µs from the step's start of
        the first launch and the end of the last, time inside and between launches, when the GPU
        starts and ends, its busy time, its idle time while waiting for a launch, its gaps over
        50 µs, and per driver call name [count, µs]).
    """
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
