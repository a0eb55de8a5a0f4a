"""Custom dispatches: draft top-K with log-probs, one kernel body for every backend.

`topk.topk_dispatch(n, V, K, arch)` gives the MLIR to splice into a compiled module (see
kernels/README.md); `check` is `dflash-iree topk-check`; `build` is `make kernels`.
"""
