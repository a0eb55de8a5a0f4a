"""The float64 NumPy reference for draft top-K, the parity cases, and how a result is scored.

Needs NumPy only, so it runs wherever the runtime does (the lent GPU machine has no compiler).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Case:
    """One parity row: logits [n, V], K, temperature T."""

    n: int
    V: int
    K: int
    T: float = 1.0

    @property
    def label(self) -> str:
        return f"n={self.n} V={self.V} K={self.K} T={self.T:g}"


# The table (#5), in its order; the K=65 contract row is separate (a refusal, not a run).
CASES = (
    Case(15, 151936, 8, 1.0), Case(15, 151936, 8, 0.7), Case(15, 151936, 8, 2.0),
    Case(1, 151936, 8), Case(7, 1024, 8), Case(32, 4096, 8), Case(3, 257, 8),
    Case(1, 151936, 1), Case(15, 151936, 4),
)
CONTRACT_K = 65
LP_TOL = 2e-3


def make_logits(n: int, V: int, K: int, rng: np.random.Generator) -> np.ndarray:
    """Fresh float32 logits [n, V] without zeros, with planted ties in every row.

    Per row: the maximum is raised and copied to three random positions (ties at the top, where
    lower id must come first), then a random lower element is set equal to the K-th largest
    (a tie across the top-K boundary, where the lower id is the one kept).
    """
    x = (rng.standard_normal((n, V)) * 4.0).astype(np.float32)
    x[x == 0] = 0.5
    for r in range(n):
        row = x[r]
        top = rng.choice(V, size=3, replace=False)
        row[top] = row.max() + np.float32(0.5)
        order = np.argsort(-row, kind="stable")
        boundary = row[order[K - 1]]
        below = order[K + 3:]
        if below.size:
            row[rng.choice(below)] = boundary
    return x


def reference(x: np.ndarray, K: int, T: float) -> tuple[np.ndarray, np.ndarray]:
    """(ids [n, K] by descending logit, equal logits by lower id; log_softmax(x / T) [n, V] in float64)."""
    ids = np.argsort(-x, axis=1, kind="stable")[:, :K]
    y = x.astype(np.float64) / T
    m = y.max(axis=1, keepdims=True)
    lsm = y - (m + np.log(np.exp(y - m).sum(axis=1, keepdims=True)))
    return ids, lsm


def score(x: np.ndarray, T: float, ids: np.ndarray, lps: np.ndarray) -> dict:
    """Scores a kernel result against the reference.

    id_mismatch: positions whose id differs from the reference's and is not an exactly equal
    logit (out-of-range ids, repeated ids in a row, and unwritten poison count here);
    tie_swap: positions holding another id of exactly the same logit (allowed);
    max_lp_err: max |log-prob - reference log-prob at the returned id| (inf for a bad id or NaN).
    """
    n, K = ids.shape
    ref, lsm = reference(x, K, T)
    mismatch = swaps = 0
    err = 0.0
    for r in range(n):
        seen = set()
        for j in range(K):
            i = int(ids[r, j])
            if not 0 <= i < x.shape[1] or i in seen:
                mismatch += 1
                err = float("inf")
                continue
            seen.add(i)
            if i != ref[r, j]:
                if x[r, i] == x[r, ref[r, j]]:
                    swaps += 1
                else:
                    mismatch += 1
            e = abs(float(lps[r, j]) - lsm[r, i])
            err = max(err, e if np.isfinite(e) else float("inf"))
    return {"id_mismatch": mismatch, "tie_swap": swaps, "max_lp_err": float(err),
            "pass": bool(mismatch == 0 and err <= LP_TOL)}
