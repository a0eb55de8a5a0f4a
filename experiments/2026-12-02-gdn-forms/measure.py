"""Host measurements of the Gated DeltaNet's forms (eager torch, f32, one layer, one stream).

1. prefill: `recurrent_rule` (token by token) vs `chunked_rule` (chunks of 64) over T tokens;
2. rollback after a verify of B rows with a accepted, per layer:
   - slots: the verify keeps the state after each row (B states written), the next call reads one;
   - replay: the verify keeps its start state (one checkpoint) and each row's (k, v, beta, g); the
     next call replays the a + 1 accepted steps from the checkpoint.
Prints a table and writes results.json next to this file. Run: python3 measure.py [--heads Hv --dk dk]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from dflash_iree.export.gdn import chunked_rule, delta_step, prepare, recurrent_rule


def best(fn, reps=5):
    fn()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return min(ts) * 1e3


def inputs(T, Hk, Hv, dk):
    q, k = torch.randn(1, T, Hk, dk), torch.randn(1, T, Hk, dk)
    v, beta, g = torch.randn(1, T, Hv, dk), torch.rand(1, T, Hv), -torch.rand(1, T, Hv)
    return prepare(q, k, v, beta, g)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--heads", type=int, default=48)  # Qwen3.5-27B: 48 value heads, 16 key heads, dk = dv = 128
    ap.add_argument("--key-heads", type=int, default=16)
    ap.add_argument("--dk", type=int, default=128)
    ap.add_argument("--block", type=int, default=16)
    a = ap.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    Hv, Hk, dk, B = a.heads, a.key_heads, a.dk, a.block
    state0 = torch.zeros(1, Hv, dk, dk)
    rows = {"shape": {"Hv": Hv, "Hk": Hk, "dk": dk, "block": B}, "prefill_ms": {}, "rollback_ms": {}}
    with torch.no_grad():
        for T in (64, 256):
            x = inputs(T, Hk, Hv, dk)
            rows["prefill_ms"][T] = {"per_token": best(lambda: recurrent_rule(*x, state0), 3),
                                     "chunked": best(lambda: chunked_rule(*x, state0), 3)}
        x = inputs(B, Hk, Hv, dk)
        slots = torch.zeros(B, Hv, dk, dk)

        def verify_slots():
            _, states = recurrent_rule(*x, state0)
            slots.copy_(torch.cat(states, 0))

        def verify_checkpoint():
            recurrent_rule(*x, state0)  # outputs only; the state is not kept

        def replay(acc):
            s = state0
            for t in range(acc + 1):
                _, s = delta_step(s, *(y[:, :, t] for y in x))
            return s

        rows["rollback_ms"] = {
            "verify+slots": best(verify_slots), "verify (checkpoint)": best(verify_checkpoint),
            "read slot": best(lambda: slots[3:4].clone()),
            **{f"replay a={acc}": best(lambda acc=acc: replay(acc)) for acc in (0, B // 2, B - 1)}}
    for name, table in (("prefill (ms, one layer)", rows["prefill_ms"]), ("rollback (ms, one layer)", rows["rollback_ms"])):
        print(f"\n{name}")
        for k, v in table.items():
            print(f"  {k!s:>20}: {v}")
    (Path(__file__).parent / "results.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
