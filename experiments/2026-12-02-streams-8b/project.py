"""Project the demo pair's acceptance onto the Qwen3-8B shape's measured step costs (issue #29).

    .venv/bin/python experiments/2026-12-02-streams-8b/project.py streams_8b_h200.json acceptance_demo.json --json projection.json

Replays each prompt's recorded per-round accepted counts (record_acceptance.py) through a 4-slot
continuous batch, as runtime/batch.py runs it: a queue of the prompts, a slot takes the next prompt
when its request ends, and every round (DFlash) or step (plain) costs the measured call at the
number of streams it runs (h200_8b_streams.py): with one stream running, the S = 4 module's
one-stream form where measured (`*_one_stream`), else its S-stream call with three idle slots. Decoding only: the prefills are left out of both arms
alike. Prints the table and writes JSON.
"""

import argparse
import json
from pathlib import Path


def batch_time(seqs: list[list[int]], slots: int, cost_all: float, cost_one: float) -> tuple[float, int]:
    """Wall ms to run every sequence of per-round token counts through `slots` slots: a round costs
    cost_all, or cost_one when one stream alone is active. Returns (ms, rounds)."""
    queue = list(seqs)
    active = [list(queue.pop(0)) for _ in range(min(slots, len(queue)))]
    ms, rounds = 0.0, 0
    while active:
        ms += cost_one if len(active) == 1 else cost_all
        rounds += 1
        for a in active:
            a.pop(0)
        active = [a for a in active if a]
        while queue and len(active) < slots:
            active.append(list(queue.pop(0)))
    return ms, rounds


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("costs")
    ap.add_argument("acceptance")
    ap.add_argument("--json", required=True)
    args = ap.parse_args()
    costs = {k: v["median_ms"] for k, v in json.loads(Path(args.costs).read_text())["steps"].items()}
    acc = json.loads(Path(args.acceptance).read_text())
    rounds = [[a + 1 for a in s["accepted"]] for s in acc["sequences"]]
    tokens = sum(sum(r) for r in rounds)
    plain_steps = [[1] * sum(r) for r in rounds]
    rows = {}
    ms, _ = batch_time(plain_steps, 1, costs["s1_decode_ahead_per_token"], costs["s1_decode_ahead_per_token"])
    rows["plain, 1 stream (S=1 module, decode_ahead)"] = tokens / ms * 1e3
    ms, _ = batch_time(rounds, 1, costs["s1_verify_draft"], costs["s1_verify_draft"])
    rows["DFlash, 1 stream (S=1 module)"] = tokens / ms * 1e3
    one_round = costs.get("s4_verify_draft_one_stream", costs["s4_verify_draft_one_active"])
    one_step = costs.get("s4_decode_one_stream", costs["s4_decode"])
    ms, _ = batch_time(rounds, 1, one_round, one_round)
    rows["DFlash, 1 stream (S=4 module)"] = tokens / ms * 1e3
    ms, _ = batch_time(plain_steps, 4, costs["s4_decode"], one_step)
    rows["plain, 4 streams (S=4 module, decode)"] = tokens / ms * 1e3
    ms, _ = batch_time(rounds, 4, costs["s4_verify_draft"], one_round)
    rows["DFlash, 4 streams (S=4 module)"] = tokens / ms * 1e3
    tau = tokens / sum(len(r) for r in rounds)
    ratios = {
        "4-stream DFlash / 4-stream plain (goal >= 1.3)": rows["DFlash, 4 streams (S=4 module)"] / rows["plain, 4 streams (S=4 module, decode)"],
        "4-stream plain / 1-stream plain (goal >= 3)": rows["plain, 4 streams (S=4 module, decode)"] / rows["plain, 1 stream (S=1 module, decode_ahead)"],
        "1-stream DFlash, S=4 / S=1 module (goal >= 0.97)": rows["DFlash, 1 stream (S=4 module)"] / rows["DFlash, 1 stream (S=1 module)"],
        "1-stream DFlash / 1-stream plain": rows["DFlash, 1 stream (S=1 module)"] / rows["plain, 1 stream (S=1 module, decode_ahead)"],
    }
    print(f"{len(rounds)} prompts, {tokens} tokens, τ {tau:.3f} ({acc['where']})\n")
    print("| arm | projected tok/s |\n|---|---|")
    for k, v in rows.items():
        print(f"| {k} | {v:.1f} |")
    print("\n| ratio | value |\n|---|---|")
    for k, v in ratios.items():
        print(f"| {k} | {v:.3f} |")
    print("\n| step (ms, median) | |\n|---|---|")
    for k, v in costs.items():
        print(f"| {k} | {v:.3f} |")
    Path(args.json).write_text(json.dumps({"costs_ms": costs, "tau": round(tau, 3), "tokens": tokens,
                                           "tok_s": {k: round(v, 1) for k, v in rows.items()},
                                           "ratios": {k: round(v, 3) for k, v in ratios.items()}}, indent=1) + "\n")


if __name__ == "__main__":
    main()
