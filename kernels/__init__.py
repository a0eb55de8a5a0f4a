"""Custom dispatches, one kernel body for every backend: draft top-K with log-probs, and the skinny GEMM
of the verify / draft matmuls.

`topk.topk_dispatch(n, V, K, arch)` and `gemm.gemm_dispatch(M, N, K, arch)` give the MLIR that
export/splice.py splices into the exported module (see kernels/README.md); `check` is
`dflash-iree topk-check`; `build` is `make kernels`.
"""
