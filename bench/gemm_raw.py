"""The skinny-GEMM kernel objects (PTX) launched directly, without IREE: bench/gemm_bench.py's raw
arm (`run --ptx DIR`), for trying build variants of kernels/gemm/gemm_gpu.cu on a CUDA GPU.

DIR holds the PTX files and variants.json: a list of {name, file, threads, bn (columns a
workgroup), round (k-values a round), rows (per m-tile, default 16), optional ms, splits
("NxK": [counts]) and passes}. Needs CuPy and torch.
"""

from __future__ import annotations

import math
from pathlib import Path


class Raw:
    """Kernel objects (PTX) launched directly through CuPy on torch's current stream (for variants)."""

    def __init__(self, ptx: Path, threads: int, bn: int, rnd: int, rows: int = 16):
        import cupy

        self.cupy = cupy
        self.mod = cupy.RawModule(path=str(ptx))
        self.threads, self.bn, self.rnd, self.rows = threads, bn, rnd, rows

    def plan_splits(self, N, K, splits=None):
        rounds = K // self.rnd
        cb = math.ceil(N / self.bn)
        if splits is None:
            splits = next((s for s in range(1, rounds + 1) if rounds % s == 0 and cb * s >= 264), rounds)
        return cb, splits

    def split_candidates(self, N, K):
        """Split counts worth trying: whole rounds per split, 132..1100 workgroups (at most 4), or 1."""
        rounds, cb = K // self.rnd, math.ceil(N / self.bn)
        c = [s for s in range(1, rounds + 1) if rounds % s == 0 and 132 <= cb * s <= 1100][:4]
        return c or [1]

    def regs(self, M):
        """Registers per thread of the entry point for M rows, as the driver compiled it."""
        return self.mod.get_function(f"dflash_gemm_mt{math.ceil(M / self.rows)}").num_regs

    def launcher(self, x, w, M, N, K, splits, passes=1):
        import numpy as np
        import torch

        cb, S = self.plan_splits(N, K, splits)
        f = self.mod.get_function(f"dflash_gemm_mt{math.ceil(M / self.rows)}")
        y = torch.full((M, N), float("nan"), dtype=torch.bfloat16, device="cuda")  # an unwritten output fails parity
        part = torch.empty(S * M * N if S > 1 else 1, dtype=torch.float32, device="cuda")
        cnt = torch.zeros(cb, dtype=torch.int32, device="cuda")
        i32, u64 = np.int32, np.uint64
        gx = math.ceil(cb / passes)  # workgroups along the column blocks (each takes `passes` in turn)

        def go(wt=w):
            st = self.cupy.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream)
            f((gx, S, 1), (self.threads, 1, 1), (u64(x.data_ptr()), u64(wt.data_ptr()), u64(cnt.data_ptr()),
                                                 u64(y.data_ptr()), u64(part.data_ptr()), i32(M), i32(K),
                                                 i32(K // S), i32(S), i32(gx), i32(N)), stream=st)
            return y

        return go, S
