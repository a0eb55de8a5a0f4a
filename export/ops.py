"""The named ops of the export: every custom kernel the model uses, called by name.

torch.export keeps a custom op as one node and the FX importer writes it as
`torch.operator "torch.dflash.<name>"`, so the lowering (export/splice.py) finds each one by its name
and never has to recognise the ops around it. Per arch it replaces an op with that arch's kernel
(kernels/) or, where the arch's rules give the op to IREE, with the op's reference result.

Forms. The model computes each op's reference form with ordinary torch ops (what eager runs: the
eager modules stay the reference, bit for bit) and, while exporting, passes that result to the
named op as its `ref` operand next to the op's real inputs (x, the weights, the cache and the
layer, ...). Lowered to IREE, the op becomes its `ref`: IREE sees exactly the ops it would see
without the named op. Lowered to a kernel, the op becomes a call on its real inputs and the
reference ops are left dead (IREE drops them). Where the host exports another reference form
(`attend_matmul` for the attention, export/qwen3.py `ATTENTION`), that is the `ref`. The norm + rope
and the top-K have no `ref`: every arch that exports them has their kernel (the norm + rope is
exported by the GPU form only).

The ops (shapes: S streams, T tokens, M = S * T rows; dtypes: one float dtype throughout unless said):
- `dflash::linear(x [..., K], weights [[N_i, K]], refs [[..., N_i]], scales, zeros, group_size[, norm, eps])`:
  y_i = x . W_i^T for 1 or more weights of one x (a layer's q, k and v; the drafter's context k and v
  of all its layers), results in the weights' order. With `norm` [K] (an RMSNorm's weight) and its
  eps, y_i = rms_norm(x) . W_i^T: the norm before the GEMM is part of the op, so that decode's one
  row can take it in the GEMM's prologue (issue #24; export/lower_linear.py).
- `dflash::linear_residual(x [..., K], weights [[N, K]], residual [..., N], ref, ...)`:
  residual + x . W^T (o_proj and down_proj with the residual add).
- `dflash::linear_swiglu(x [..., K], weights [gate [I, K], up [I, K]], ref, ...[, norm, eps])`:
  silu(x . G^T) * (x . U^T) (the MLP's gate and up); with `norm`, of rms_norm(x) as for `linear`.
- `dflash::block_attention(q [S, T, Hq, hd], cache [S, L, 2, C, Hkv * hd], layer, mask, ref, gate, scale)`:
  a block's attention over the first N rows of one layer of the KV cache.
- `dflash::head_norm_rope(x [S, T, H, X], weight [hd], cos, sin [S, T, rotary_dim or hd], eps, zero_centered,
  rotary_dim)`: each head the first hd <= X values of x (X = 2 hd: Qwen3.5's q inside q_proj's [query, gate] heads).
- `dflash::norm_rope_kv_write(q [S, T, Hq, hd], wq, k [S, T, Hkv, hd], wk, cos, sin, eps, v, cache, rows, ref_q,
  ref_cache)`: a layer's q and k norm + rope with k's result and v written into the KV cache
  [S, L, 2, C, Hkv * hd] at the flat rows int64 [S * 2T] (export/qwen3.py `cache_rows`); returns (q, the
  cache after the write). Two references, as the GDN step's: the export threads the cache through
  the layers as a value (export/qwen3.py `Qwen3.forward`).
- `dflash::topk_logprobs(logits [n, V] f32, temperature [] f32, k)`.
- `dflash::gated_delta_rule(mixed [S, T, conv_dim], b, a [S, T, Hv], A_log, dt_bias [Hv], rows int32 [S, 2],
  slots f32 [streams, slots, n_gdn, Hv, dk, dv], layer, key_heads, every_row, ref_o [S, T, Hv, dv], ref_slots)`:
  one Gated DeltaNet layer's token-by-token rule (export/gdn.py), its per-row states (or, every_row
  False, a prefill block's last state) written into the state slots; returns (o, the slots after the write). Two references: `ref_o` and `ref_slots`
  (export/qwen35.py `Qwen35.step`: the slots are threaded through the GDN layers as a value).

The linear ops take a packed 4-bit form ("Packed 4-bit form" below; `scales` [] and `group_size` 0 for
plain weights); M = 1 runs through the same op as a verify block (which rows take a kernel is the
lowering's rule, not the op's).

Packed 4-bit form (export/quantized.py's `QuantLinear`, as the checkpoint stores it; export/qwen3.py
`_operands`): each weight is int32 [N_i, K / 8], eight 4-bit values a word along K; `scales` one
tensor per weight, [N_i, K / group_size] in the stored dtype; `zeros` MLX's biases (one per weight,
like the scales: w = scale * q + bias), compressed-tensors' zero points (int32 [ceil(N_i / 8),
K / group_size], packed along N: w = scale * (q - z)), or [] (compressed-tensors symmetric:
w = scale * (q - 8)). The lowering tells the three apart by the zeros' presence and dtype.
"""

from __future__ import annotations

from typing import Optional

import torch

from dflash_iree.kernels.topk import MAX_K


def exporting() -> bool:
    """Whether the model is being traced by torch.export (the IREE path: call the named ops), and not
    run eagerly or compiled by torch.compile.

    `torch.compiler.is_exporting()` alone is not enough: dynamo answers True for it under plain
    torch.compile too in the torch releases before the fix (its `tracing_state_functions`,
    pytorch/pytorch#176347, fixed by #176499; the pinned 2.13.0 has the fix, the H200's 2.11 not).
    On the H200 that made the torch.compile peer of bench/speed_8b.py trace the export path, the
    named ops' references and opaque calls included (a whole-cache copy a layer for the KV write's),
    not the eager model (experiments/2026-12-06-kv-write/). torch.export, strict and not, also sets `torch.compiler._is_exporting_flag`, which torch.compile leaves False.
    """
    return torch.compiler.is_exporting() and getattr(torch.compiler, "_is_exporting_flag", True)


# What the FX importer names each op in the exported module (export/splice.py looks them up).
LINEAR_OP = "torch.dflash.linear"
LINEAR_RESIDUAL_OP = "torch.dflash.linear_residual"
LINEAR_SWIGLU_OP = "torch.dflash.linear_swiglu"
ATTENTION_OP = "torch.dflash.block_attention"
NORM_ROPE_OP = "torch.dflash.head_norm_rope"
NORM_ROPE_KV_OP = "torch.dflash.norm_rope_kv_write"
TOPK_OP = "torch.dflash.topk_logprobs"
GDN_OP = "torch.dflash.gated_delta_rule"


@torch.library.custom_op("dflash::linear", mutates_args=())
def linear(x: torch.Tensor, weights: list[torch.Tensor], refs: list[torch.Tensor],
           scales: list[torch.Tensor], zeros: list[torch.Tensor], group_size: int,
           norm: Optional[torch.Tensor] = None, eps: float = 0.0) -> list[torch.Tensor]:
    """x . W_i^T (with `norm`: rms_norm(x) . W_i^T) for each weight W_i of one x, one op (one grouped
    dispatch where the arch takes it).

    Args:
        x: [..., K].
        weights: [N_i, K] each, x's dtype; packed 4-bit (with `scales`): int32 [N_i, K / 8] (module
            docstring, "Packed 4-bit form").
        refs: [..., N_i] each: the op's result as the model computes it (the reference form).
        scales, zeros: [] for plain weights; packed 4-bit: the scales and biases or zero points of
            the module docstring. group_size: input columns per scale; 0 for plain weights.
        norm, eps: None, or the weight [K] (x's dtype) and eps of the RMSNorm applied to x first
            (export/qwen3.py `rms_norm`).

    Returns:
        [..., N_i] per weight, equal to `refs` (the eager body returns copies of them).
    """
    return [r.clone() for r in refs]


@linear.register_fake
def _linear_fake(x, weights, refs, scales, zeros, group_size, norm=None, eps=0.0):
    torch._check(len(weights) == len(refs) and len(weights) >= 1)
    return [torch.empty_like(r) for r in refs]


@torch.library.custom_op("dflash::linear_residual", mutates_args=())
def linear_residual(x: torch.Tensor, weights: list[torch.Tensor], residual: torch.Tensor, ref: torch.Tensor,
                    scales: list[torch.Tensor], zeros: list[torch.Tensor], group_size: int) -> torch.Tensor:
    """residual + x . W^T (o_proj, down_proj and the residual add after them), one op.

    Args:
        x: [..., K]; weights: [W] with W [N, K]; residual, ref: [..., N], ref = residual + x . W^T
            as the model computes it. scales, zeros, group_size: as for `linear`.

    Returns:
        [..., N], equal to `ref`.
    """
    return ref.clone()


@linear_residual.register_fake
def _linear_residual_fake(x, weights, residual, ref, scales, zeros, group_size):
    torch._check(len(weights) == 1)
    return torch.empty_like(ref)


@torch.library.custom_op("dflash::linear_swiglu", mutates_args=())
def linear_swiglu(x: torch.Tensor, weights: list[torch.Tensor], ref: torch.Tensor,
                  scales: list[torch.Tensor], zeros: list[torch.Tensor], group_size: int,
                  norm: Optional[torch.Tensor] = None, eps: float = 0.0) -> torch.Tensor:
    """silu(x . G^T) * (x . U^T): the MLP's gate and up projections and their product, one op (with
    `norm`: of rms_norm(x)).

    Args:
        x: [..., K]; weights: [G, U], each [I, K]; ref: [..., I] as the model computes it.
            scales, zeros, group_size, norm, eps: as for `linear`.

    Returns:
        [..., I], equal to `ref`.
    """
    return ref.clone()


@linear_swiglu.register_fake
def _linear_swiglu_fake(x, weights, ref, scales, zeros, group_size, norm=None, eps=0.0):
    torch._check(len(weights) == 2)
    return torch.empty_like(ref)


@torch.library.custom_op("dflash::block_attention", mutates_args=())
def block_attention(q: torch.Tensor, cache: torch.Tensor, layer: int, mask: torch.Tensor, ref: torch.Tensor,
                    gate: Optional[torch.Tensor] = None, scale: Optional[float] = None) -> torch.Tensor:
    """A block's grouped-query attention over one layer of the KV cache, read in place.

    Args:
        q: [S, T, Hq, hd], the block's rotated queries (Hq = g * Hkv; any g and hd: the op sets no limit).
        cache: [S, L, 2, C, Hkv * hd], the KV cache after this step's write (keys of layer l at
            [:, l, 0], values at [:, l, 1], head h at columns [h * hd, (h + 1) * hd)).
        layer: the layer l to read.
        mask: bool [S, 1, T * g, N]: True where query row t * g + j (token t, query head h * g + j of
            KV head h) sees key n; the keys are the first N cache rows (export/qwen3.py `query_rows_mask`).
        ref: [S, T, Hq * hd], the attention as the model computes it (softmax(q k^T * scale) v per head).
        gate: None, or [S, T, Hq * hd]: a gated output, ref already multiplied by sigmoid(gate)
            (the Qwen3.5 family; the gated block-attention kernel applies it, export/lower_attention.py).
        scale: the softmax scale; None for hd ** -0.5.

    Returns:
        [S, T, Hq * hd] in q's dtype, equal to `ref`.
    """
    return ref.clone()


@block_attention.register_fake
def _block_attention_fake(q, cache, layer, mask, ref, gate=None, scale=None):
    return torch.empty_like(ref)


@torch.library.custom_op("dflash::head_norm_rope", mutates_args=())
def head_norm_rope(x: torch.Tensor, weight: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   eps: float, zero_centered: bool = False, rotary_dim: int = 0) -> torch.Tensor:
    """`apply_rope(rms_norm(x, weight, eps), cos, sin)` of export/qwen3.py (Qwen3's q/k norm and rope),
    or `partial_rope(zc_rms_norm(x, weight, eps), cos, sin)` of export/qwen35.py (Qwen3.5's), as one op.

    Args:
        x: [S, T, H, X] with X >= hd: each head is x[..., :hd] (X = hd, or X = 2 hd for q read in
            place from q_proj's interleaved [query, gate] heads; the kernel reads it strided where
            IREE would copy the slice out in a dispatch of its own).
        weight: [hd]; cos, sin: [S, T, rotary_dim or hd]; all of one dtype (f32, bf16, f16).
        eps: the RMSNorm epsilon.
        zero_centered: the norm scales by (1 + weight), in float32, with one rounding to x's dtype
            (`zc_rms_norm`), instead of weight * the normed value rounded (`rms_norm`).
        rotary_dim: rotate only the first rotary_dim dims of each head, the rest pass through
            (`partial_rope`); 0 or hd for all of them.

    Returns:
        [S, T, H, hd] in x's dtype, bit for bit what the eager modules compute.
    """
    from .qwen3 import apply_rope, rms_norm  # both import this module
    from .qwen35 import partial_rope, zc_rms_norm

    hd = weight.shape[-1]
    x = x[..., :hd]
    y = zc_rms_norm(x, weight, eps) if zero_centered else rms_norm(x, weight, eps)
    if rotary_dim in (0, hd):
        return apply_rope(y, cos, sin)
    return partial_rope(y, cos[..., :rotary_dim], sin[..., :rotary_dim])


@head_norm_rope.register_fake
def _head_norm_rope_fake(x, weight, cos, sin, eps, zero_centered=False, rotary_dim=0):
    torch._check(weight.shape[-1] <= x.shape[-1])
    return x.new_empty((*x.shape[:-1], weight.shape[-1]))


@torch.library.custom_op("dflash::norm_rope_kv_write", mutates_args=())
def norm_rope_kv_write(q: torch.Tensor, wq: torch.Tensor, k: torch.Tensor, wk: torch.Tensor, cos: torch.Tensor,
                       sin: torch.Tensor, eps: float, v: torch.Tensor, cache: torch.Tensor, rows: torch.Tensor,
                       ref_q: torch.Tensor, ref_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q_norm / k_norm and RoPE of a layer, with its keys and values written into the KV cache (kernels/norm_rope/).

    Args:
        q: [S, T, Hq, hd], k, v: [S, T, Hkv, hd], q_proj's, k_proj's and v_proj's results; wq, wk: [hd],
            the q_norm and k_norm weights; cos, sin: [S, T, hd]; eps: the norms' epsilon.
        cache: [S, L, 2, C, Hkv * hd], the KV cache as the layers before this one left it.
        rows: int64 [S * 2T], this layer's flat cache rows (export/qwen3.py `cache_rows`).
        ref_q: [S, T, Hq, hd], `apply_rope(q_norm(q), cos, sin)` as eager computes it; ref_cache: the
            cache after eager's write of the rotated k and v (export/qwen3.py `written_cache`).

    Returns:
        (q, cache): copies of (ref_q, ref_cache). The kernel's are its rotated q and `cache` itself,
        written in place; its k rows are the head norm + rope kernel's (bit for bit as eager's).
    """
    return ref_q.clone(), ref_cache.clone()


@norm_rope_kv_write.register_fake
def _norm_rope_kv_write_fake(q, wq, k, wk, cos, sin, eps, v, cache, rows, ref_q, ref_cache):
    return torch.empty_like(ref_q), torch.empty_like(ref_cache)


@torch.library.custom_op("dflash::topk_logprobs", mutates_args=())
def topk_logprobs(logits: torch.Tensor, temperature: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The k best ids of each row and their log-probabilities: what kernels/topk/ computes.

    Args:
        logits: float32 [n, V].
        temperature: float32 [] (a 0-d tensor), > 0.
        k: 1..min(64, V).

    Returns:
        ids: int32 [n, k], by descending logit, equal logits by lower id (kernels/topk/reference.py).
        logprobs: float32 [n, k], log_softmax(logits / temperature) at those ids (computed in
            float64, then rounded).
    """
    order = torch.sort(logits, dim=-1, descending=True, stable=True).indices[:, :k]
    lsm = torch.log_softmax(logits.double() / temperature.double(), dim=-1)
    return order.to(torch.int32), lsm.gather(-1, order).float()


@topk_logprobs.register_fake
def _topk_logprobs_fake(logits, temperature, k):
    torch._check(logits.dim() == 2 and 1 <= k <= min(MAX_K, logits.shape[1]))
    n = logits.shape[0]
    return logits.new_empty((n, k), dtype=torch.int32), logits.new_empty((n, k), dtype=torch.float32)


@torch.library.custom_op("dflash::gated_delta_rule", mutates_args=())
def gated_delta_rule(mixed: torch.Tensor, b: torch.Tensor, a: torch.Tensor, A_log: torch.Tensor,
                     dt_bias: torch.Tensor, rows: torch.Tensor, slots: torch.Tensor, layer: int, key_heads: int,
                     every_row: bool, ref_o: torch.Tensor, ref_slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One Gated DeltaNet layer's token-by-token gated delta rule with its state slots (kernels/gdn/).

    Args:
        mixed: [S, T, conv_dim], the causal conv's output (q | k | v: key_heads * dk, key_heads * dk,
            Hv * dv), the model dtype; b, a: [S, T, Hv], in_proj_b / in_proj_a's outputs; A_log,
            dt_bias: [Hv] (export/gdn.py `GatedDeltaNet`).
        rows: int32 [S, 2]: per stream, the flat slot row (slots viewed as [streams * slots, ...]) of
            the state before row 0 (-1: a fresh sequence, zeros), and the flat row of slot 0.
        slots: float32 [streams, slots, n_gdn, Hv, dk, dv], the recurrent-state slots as the layers
            before this one left them (export/recurrent_state.py).
        layer: this layer's index among the GDN layers; key_heads: Hk.
        every_row: the state after each row t goes to flat row rows[s, 1] + t (decode, verify), or
            False, the state after the last row only, to rows[s, 1] (a prefill's block of up to 16
            rows; the next block reads it there).
        ref_o: [S, T, Hv, dv] in the model dtype, o as the eager rule computes it.
        ref_slots: the slots after the reference's write (export/qwen35.py `Qwen35.step`: the slots
            input for every GDN layer but the last, whose ref_slots carry every layer's states: the
            lowering gives all of a module's ops to the kernel or all to IREE).

    Returns:
        (o, slots): copies of (ref_o, ref_slots). The kernel's are o and `slots` with layer `layer`'s
        flat rows rows[s, 1] + t replaced by the state after row t (every_row; else row
        rows[s, 1] by the state after the last row).
    """
    return ref_o.clone(), ref_slots.clone()


@gated_delta_rule.register_fake
def _gated_delta_rule_fake(mixed, b, a, A_log, dt_bias, rows, slots, layer, key_heads, every_row, ref_o, ref_slots):
    return torch.empty_like(ref_o), torch.empty_like(ref_slots)


def top_k_per_stream(logits: torch.Tensor, temperature: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`topk_logprobs` for every stream: logits float32 [S, n, V], temperature float32 [S] (> 0).

    Returns ids int32 [S, n, k] and log-probs float32 [S, n, k] (one op, one dispatch, per stream:
    the kernel takes one temperature).
    """
    rows = [topk_logprobs(logits[s], temperature[s], k) for s in range(logits.shape[0])]
    return torch.stack([r[0] for r in rows]), torch.stack([r[1] for r in rows])
