"""Custom dispatches, one folder per kernel, one body for every backend: the draft top-K with
log-probs (`topk/`), the skinny GEMM of the verify / draft matmuls (`gemm/`), the block attention
of the verify step (`attention/`) and the head norm + rope (`norm_rope/`).

Each folder's dispatch builder (`topk_dispatch`, `gemm_dispatch`, `attention_dispatch`,
`norm_rope_dispatch`) gives the MLIR that export/splice.py splices into the exported module, bound
to the committed objects of `objects/` (see kernels/README.md); `hal.py` holds the HAL text they
share; `build` is `make kernels`; `isa` inspects the objects; `topk.check` is `dflash-iree topk-check`.
"""
