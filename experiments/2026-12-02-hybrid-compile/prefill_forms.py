"""Prefill of a hybrid target on the host, compiled: whole 64-row chunks through `prefill` (the
chunked rule, last state kept) against the same prompt through `verify` alone in blocks of B (the
per-token rule, every row's state kept), both from one compiled module; and the tokens agree.

Run: python3 experiments/2026-12-02-hybrid-compile/prefill_forms.py ARTIFACTS [PROMPT_LEN]
(ARTIFACTS: a hybrid compile, e.g. the tiny pair of tests/conftest.py `hybrid_pair`). Prints JSON.
"""

from __future__ import annotations

import json
import statistics
import sys
import time

from dflash_iree.runtime.engine import Engine


def main() -> None:
    folder = sys.argv[1]
    n = int(sys.argv[2]) if len(sys.argv) > 2 else 128
    m = Engine.load(folder).module
    chunk = m.prefill_chunk
    prompt = [(7 * i + 3) % 509 for i in range(n)]
    out = {"prompt_len": n, "prefill_chunk": chunk, "block_size": m.block_size}
    for name, c in (("chunked_prefill", chunk), ("verify_only", 10**9)):
        m.prefill_chunk = c
        times, firsts = [], set()
        for _ in range(7):
            t0 = time.perf_counter()
            first, _ = m.prefill(prompt)
            times.append(time.perf_counter() - t0)
            firsts.add(first)
        out[name] = {"median_ms": round(1e3 * statistics.median(times[1:]), 2), "first_tokens": sorted(firsts)}
    m.prefill_chunk = chunk
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
