"""The Qwen3 dense target: eager reference and `torch.export` source in one `nn.Module`.

Parameter names equal the Hugging Face safetensors keys (`model.layers.0.self_attn.q_proj.weight`,
`lm_head.weight`, ...), so a compiled artifact binds a checkpoint file as it is.

One forward runs a block of T new tokens per stream at absolute positions [start, start + T):
- the KV cache is a non-persistent buffer [S, L, 2, max_context, kv_dim] (S streams), written by
  one `index_copy_` per layer on a flat view (per-slice writes do not compile in IREE, see
  shared/probes/kv-cache-global), or in the GPU export by the norm + rope's named op, the cache
  threaded through the layers (`DecoderLayer.step`), and rolled back by keeping the length on the host;
- attention reads only the first `read_len` cache rows, masked to key position <= query position;
- it returns the target's chosen token per row (argmax or keyed sample, export/sampling.py), the
  logits, and the taps for the drafter: HF's `hidden_states[lid + 1]` for each `lid` in
  `tap_layer_ids`, that is the output of decoder layer `lid` (for the last layer HF applies the
  final norm first, and so do we).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dflash_iree.config import LayerShape, TargetConfig

from . import ops
from .rope import rope_tables  # noqa: F401  (cos, sin of positions, plain or YaRN; imported from here)
from .sampling import Sampling, choose_tokens


def _named(*linears: nn.Module) -> bool:
    """Whether to call the named ops (export/ops.py): while exporting, for linears without a bias (the
    kernels add none; a biased linear stays IREE's matmul + add), all float or all packed 4-bit in
    one format and group (export/quantized.py `QuantLinear`, whose packed tensors the op then
    takes: `_operands`)."""
    if not ops.exporting() or any(lin.bias is not None for lin in linears):
        return False
    from .quantized import QuantLinear

    packed = [isinstance(lin, QuantLinear) for lin in linears]
    if not any(packed):
        return all(isinstance(lin, nn.Linear) for lin in linears)
    return all(packed) and len({(lin.method, lin.group_size, lin.symmetric) for lin in linears}) == 1


def _operands(linears) -> tuple[list, list, list, int]:
    """(weights, scales, zeros, group_size) of the named linear ops for LINEARS: float weights and
    [], [], 0; or packed 4-bit (export/ops.py "Packed 4-bit form")."""
    from .quantized import QuantLinear

    if not isinstance(linears[0], QuantLinear):
        return [lin.weight for lin in linears], [], [], 0
    return ([lin.packed() for lin in linears], [lin.scale_tensor() for lin in linears],
            [z for lin in linears for z in [lin.offset_tensor()] if z is not None], linears[0].group_size)


def _op_input(x: torch.Tensor, h: torch.Tensor, linears, norm: "RMSNorm | None") -> tuple:
    """The linear ops' x and trailing (norm, eps): x and the norm for float weights, whose GEMM takes it
    (decode's one row in its prologue); for packed 4-bit ones h = norm(x) and none: their norm stays
    IREE's reduction within a row, row-invariant too, and faster than the norm's own dispatch (1.73
    against 2.65 us on an H100, experiments/2026-12-07-norm-prologue/) while the 4-bit GEMM has no
    prologue entry (experiments/2026-12-07-q4-norm-prologue/)."""
    from .quantized import QuantLinear

    if norm is None or isinstance(linears[0], QuantLinear):
        return h, ()
    return x, (norm.weight, norm.eps)


def project(x: torch.Tensor, linears, norm: "RMSNorm | None" = None) -> list[torch.Tensor]:
    """x [..., K] (with NORM: norm(x)) through each of LINEARS ([N_i, K]): [..., N_i] each, in x's dtype.

    Exported, one named op `dflash::linear` over all of them, a float weight's norm included (one
    grouped dispatch where the arch takes it; at decode's one row the norm in its prologue); eager, the
    norm and each `nn.Linear` (the reference).
    """
    h = x if norm is None else norm(x)
    refs = [lin(h) for lin in linears]
    if not _named(*linears):
        return refs
    w, sc, z, g = _operands(linears)
    xo, nrm = _op_input(x, h, linears, norm)
    return list(ops.linear(xo, w, refs, sc, z, g, *nrm))


def as_float32(x: torch.Tensor) -> torch.Tensor:
    """x as float32, a bf16 x through its bits: (int16 bits * 2^16) viewed as float32, the same values
    as `x.float()`. Why: IREE may fuse a bf16 truncation into its consumer and skip it, and did so for
    the lm_head in the host's decode graph and not in its verify graph, so decode took the argmax of
    unrounded logits and verify (and eager) of rounded ones, and parted at bf16 ties
    (experiments/2026-12-03-host-row-ops/). A bitcast cannot be folded away."""
    if x.dtype != torch.bfloat16 or x.requires_grad:  # training: the bit view has no gradient, and eager needs none
        return x.float()
    return (x.view(torch.int16).to(torch.int32) * 65536).view(torch.float32)  # int16 * 2^16 fits int32


def project_residual(x: torch.Tensor, lin: nn.Linear, residual: torch.Tensor) -> torch.Tensor:
    """residual + lin(x): x [..., K], residual [..., N] (exported: the named op `dflash::linear_residual`)."""
    ref = residual + lin(x)
    if not _named(lin):
        return ref
    w, sc, z, g = _operands([lin])
    return ops.linear_residual(x, w, residual, ref, sc, z, g)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm computed in float32 and cast back, then scaled in x's dtype, as HF's Qwen3RMSNorm.
    x: [..., dim]; weight: [dim]."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


class RMSNorm(nn.Module):
    """`rms_norm` with its weight. x: [..., dim]."""

    def __init__(self, dim: int, eps: float, dtype=None, device=None):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype, device=device))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, cfg: LayerShape, dtype=None, device=None):
        super().__init__()
        kw = dict(bias=False, dtype=dtype, device=device)
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, **kw)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, **kw)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, **kw)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.swiglu(x))

    def swiglu(self, x: torch.Tensor, norm: "RMSNorm | None" = None) -> torch.Tensor:
        """silu(gate(h)) * up(h), h = x or norm(x): x [..., hidden] -> [..., intermediate] (exported:
        `dflash::linear_swiglu`, the norm included for float weights; packed 4-bit: IREE's norm before
        the op, `_op_input`)."""
        h = x if norm is None else norm(x)
        ref = F.silu(self.gate_proj(h)) * self.up_proj(h)
        if not _named(self.gate_proj, self.up_proj):
            return ref
        w, sc, z, g = _operands([self.gate_proj, self.up_proj])
        xo, nrm = _op_input(x, h, [self.gate_proj], norm)
        return ops.linear_swiglu(xo, w, ref, sc, z, g, *nrm)

    def add_to(self, residual: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """residual + self(x), the MLP's half of a decoder layer (exported: two named ops)."""
        return project_residual(self.swiglu(x), self.down_proj, residual)

    def add_normed(self, x: torch.Tensor, norm: "RMSNorm") -> torch.Tensor:
        """x + self(norm(x)): x [..., hidden] -> [..., hidden] (exported: two named ops, the norm in the
        first for float weights)."""
        return project_residual(self.swiglu(x, norm), self.down_proj, x)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [S, T, H, hd] by cos, sin [S, T, hd]."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], -1)
    return x * cos[:, :, None] + rotated * sin[:, :, None]


def norm_rope(norm: RMSNorm, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attention: str) -> torch.Tensor:
    """`apply_rope(norm(x), cos, sin)`: q_norm / k_norm and RoPE of x [S, T, H, hd] (cos, sin [S, T, hd]).

    Exported in the "fused" (GPU) form as the custom op `dflash::head_norm_rope` (export/ops.py),
    which export/splice.py replaces with one dispatch (kernels/norm_rope/) where IREE's own
    lowering takes five: in decode each is a launch on the host's critical path. Eager runs (the
    reference, training) and the CPU form compute it op by op.
    """
    if attention == "fused" and ops.exporting():
        return ops.head_norm_rope(x, norm.weight, cos, sin, norm.eps)
    return apply_rope(norm(x), cos, sin)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
    """Grouped-query attention with an explicit visibility mask.

    The g = Hq / Hkv query heads that share a KV head are folded into the query rows, so each KV
    head's keys and values are read once for all of them, and the whole of it is one
    `scaled_dot_product_attention`, which IREE compiles to its fused attention op (one dispatch a
    layer, no score tensor in memory): at the Qwen3-8B shapes on the H200 that cut attention's
    device time 3.4x for a 16-row verify and 8x for decode against matmul + softmax + matmul
    (bench/attention_bench.py, experiments/2026-11-30-attention-op/). The form for GPU archs; the
    CPU runs `attend_matmul` faster (export/compile.py `Arch.attention`).

    Args:
        q: [S, T, Hq, hd]; k, v: [S, N, Hkv, hd]; visible: bool [S, T, N] (True: attend).

    Returns:
        [S, T, Hq * hd] in q's dtype: softmax(q k^T * hd ** -0.5, masked) v per head, with the
        precision of the backend's attention (float32 sums in IREE's and in PyTorch's CPU kernels).
    """
    S, T, Hq, hd = q.shape
    Hkv = k.shape[2]
    g = Hq // Hkv
    rows = q.reshape(S, T, Hkv, g, hd).permute(0, 2, 1, 3, 4).reshape(S, Hkv, T * g, hd)
    # row t * g + j is query t: select, rather than expand + reshape, which over the dynamic key
    # count leaves torch.export a guard it cannot prove
    mask = query_rows_mask(visible, g)
    out = F.scaled_dot_product_attention(rows, k.permute(0, 2, 1, 3), v.permute(0, 2, 1, 3), attn_mask=mask)
    return out.reshape(S, Hkv, T, g, hd).permute(0, 2, 1, 3, 4).reshape(S, T, Hq * hd)


def query_rows_mask(visible: torch.Tensor, g: int) -> torch.Tensor:
    """bool [S, 1, T * g, N] of visible [S, T, N]: row t * g + j is query t (`attend` folds the g query
    heads of a KV head into its rows), the same for every KV head."""
    # select, rather than expand + reshape, which over the dynamic key count leaves torch.export a
    # guard it cannot prove
    row_query = torch.arange(visible.shape[1] * g, device=visible.device) // g
    return visible.index_select(1, row_query)[:, None]


def attend_matmul(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
    """`attend` as matmul, float32 softmax, matmul: the form the CPU backend runs best.

    On IREE's llvm-cpu backend the fused attention op made the demo pair's decode step 1.5x slower
    than this (experiments/2026-11-30-one-call-rounds/demo_rounds.py --attention matmul, experiments/2026-11-30-host-attention-form/),
    while on the H200 this form is 3.4-8x slower than the fused op. Same arguments and result as
    `attend` (scores and softmax in float32).
    """
    S, T, Hq, hd = q.shape
    Hkv = k.shape[2]
    qg = q.reshape(S, T, Hkv, Hq // Hkv, hd).permute(0, 2, 3, 1, 4)  # S, Hkv, g, T, hd
    kt = k.permute(0, 2, 3, 1)[:, :, None]  # S, Hkv, 1, hd, N
    scores = torch.matmul(qg, kt).float() * (hd**-0.5)
    scores = scores.masked_fill(~visible[:, None, None], float("-inf"))
    probs = torch.softmax(scores, -1).to(v.dtype)
    out = torch.matmul(probs, v.permute(0, 2, 1, 3)[:, :, None])  # S, Hkv, g, T, hd
    return out.permute(0, 3, 1, 2, 4).reshape(S, T, Hq * hd)


ATTENTION = ("fused", "matmul")  # `attention` of the models: `attend` (+ `norm_rope`'s custom op), or `attend_matmul`


def attention_fn(attention: str):
    """The attention function named by `attention` ("fused": `attend`, "matmul": `attend_matmul`),
    looked up when called, so that training can swap `attend` (train/common.py)."""
    if attention not in ATTENTION:
        raise ValueError(f"attention {attention!r}: use one of {ATTENTION}")
    return attend if attention == "fused" else attend_matmul


class Attention(nn.Module):
    """Qwen3 attention projections with per-head q_norm / k_norm (shared by target and drafter)."""

    def __init__(self, cfg: LayerShape, dtype=None, device=None, attention: str = "fused"):
        super().__init__()
        kw = dict(bias=cfg.attention_bias, dtype=dtype, device=device)
        self.cfg = cfg
        self.attention = attention
        self.q_proj = nn.Linear(cfg.hidden_size, cfg.q_dim, **kw)
        self.k_proj = nn.Linear(cfg.hidden_size, cfg.kv_dim, **kw)
        self.v_proj = nn.Linear(cfg.hidden_size, cfg.kv_dim, **kw)
        self.o_proj = nn.Linear(cfg.q_dim, cfg.hidden_size, **kw)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, dtype, device)
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, dtype, device)

    def query(self, x: torch.Tensor, cos, sin) -> torch.Tensor:
        """x [S, T, hidden] -> rotated q [S, T, Hq, hd]."""
        S, T, _ = x.shape
        q = self.q_proj(x).view(S, T, self.cfg.num_attention_heads, self.cfg.head_dim)
        return norm_rope(self.q_norm, q, cos, sin, self.attention)

    def key_value(self, x: torch.Tensor, cos, sin) -> tuple[torch.Tensor, torch.Tensor]:
        """x [S, T, hidden] -> rotated k and v, each [S, T, Hkv, hd]."""
        return self.rotate_kv(*project(x, (self.k_proj, self.v_proj)), cos, sin)

    def rotate_kv(self, k: torch.Tensor, v: torch.Tensor, cos, sin) -> tuple[torch.Tensor, torch.Tensor]:
        """k_proj's and v_proj's results [S, T, kv_dim] -> rotated k and v, each [S, T, Hkv, hd]."""
        S, T, _ = k.shape
        shape = (S, T, self.cfg.num_key_value_heads, self.cfg.head_dim)
        return norm_rope(self.k_norm, k.view(shape), cos, sin, self.attention), v.view(shape)

    def qkv(self, x: torch.Tensor, cos, sin) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`query` and `key_value` of x [S, T, hidden] with the three projections as one named op."""
        S, T, _ = x.shape
        q, k, v = project(x, (self.q_proj, self.k_proj, self.v_proj))
        q = norm_rope(self.q_norm, q.view(S, T, self.cfg.num_attention_heads, self.cfg.head_dim), cos, sin,
                      self.attention)
        return (q, *self.rotate_kv(k, v, cos, sin))

    def qkv_written(self, x: torch.Tensor, cos, sin, cache: torch.Tensor, rows: torch.Tensor,
                    norm: "RMSNorm | None" = None) -> tuple[torch.Tensor, torch.Tensor]:
        """`qkv` of x [S, T, hidden] (with NORM: of norm(x), the norm in the projections' named op for
        float weights) with k and v written into cache at rows (`write_cache`), as the named op
        `dflash::norm_rope_kv_write`:
        the GPU export's form (`DecoderLayer.step`), one dispatch (kernels/norm_rope/) where IREE took
        the norm + rope, a copy of v and a scatter. Returns the rotated q [S, T, Hq, hd] and the cache
        after the write (a new value)."""
        S, T, _ = x.shape
        kv = (S, T, self.cfg.num_key_value_heads, self.cfg.head_dim)
        q, k, v = project(x, (self.q_proj, self.k_proj, self.v_proj), norm)
        q, k, v = q.view(S, T, self.cfg.num_attention_heads, self.cfg.head_dim), k.view(kv), v.view(kv)
        ref_q = apply_rope(self.q_norm(q), cos, sin)
        ref_cache = written_cache(cache, rows, apply_rope(self.k_norm(k), cos, sin), v)
        return ops.norm_rope_kv_write(q, self.q_norm.weight, k, self.k_norm.weight, cos, sin, self.q_norm.eps, v,
                                      cache, rows, ref_q, ref_cache)


def cache_rows(cache: torch.Tensor, positions: torch.Tensor) -> torch.Tensor | list[torch.Tensor]:
    """The rows of cache [S, L, 2, C, kv_dim]'s flat [S*L*2*C, kv_dim] view that hold the keys and
    values of int64 positions [S, T]: indexed by layer, int64 [S*2T] each, per layer the keys' T
    rows then the values' T rows of each stream. One stream: an int64 [L, 2T] tensor, computed once
    a step for every layer, so that a layer's write indexes a slice of it instead of running an
    index dispatch of its own. Several streams: a list of L int64 [S*2T] tensors, the same numbers.
    """
    S, L, _, C, _ = cache.shape
    if S > 1:
        # A row of the [L, S*2T] tensor, T dynamic (prefill, absorb), is an i64 [1, ?] slice inside
        # the cache write's scatter dispatch, which IREE 3.13's GPU codegen rejects (a 1x1 memref of
        # strides [?, 1] against its rank-reduced 1-D form; the CPU compiles it), also when the
        # tensor is built [L, S, 2T] with no transpose. Here each layer adds its constant offset to
        # one [S*2T] vector, (s*L + l)*2C + p = s*L*2C + p + l*2C, and its scatter reads that whole
        # (experiments/2026-12-02-streams-sm80/). One stream keeps the tensor: it compiles, and
        # its module (the records) stays as it was.
        streams = torch.arange(S, dtype=torch.int64, device=positions.device)[:, None]
        at = streams * (L * 2 * C) + positions  # S, T
        flat = torch.cat([at, at + C], 1).reshape(-1)
        return [flat + layer * 2 * C for layer in range(L)]
    streams = torch.arange(S, dtype=torch.int64, device=positions.device)[:, None]
    layers = torch.arange(L, dtype=torch.int64, device=positions.device)[None, :]
    at = ((streams * L + layers) * 2 * C)[:, :, None] + positions[:, None, :]  # S, L, T
    return torch.cat([at, at + C], 2).transpose(0, 1).reshape(L, -1)


def _cache_values(cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """k, v [S, T, Hkv, hd] as the [S*2T, kv_dim] rows `cache_rows` indexes: per stream T keys, then T values."""
    S, T, D = cache.shape[0], k.shape[1], cache.shape[-1]
    return torch.cat([k.reshape(S, T, D), v.reshape(S, T, D)], 1).reshape(S * 2 * T, D).to(cache.dtype)


def write_cache(cache: torch.Tensor, rows: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """Write k, v [S, T, Hkv, hd] into cache [S, L, 2, C, kv_dim] at one layer's `cache_rows` [S*2T], in place.

    One `index_copy_` on a flat [S*L*2*C, kv_dim] view: the form IREE compiles into an in-place
    update of a mutable global.
    """
    S, L, _, C, D = cache.shape
    cache.view(S * L * 2 * C, D).index_copy_(0, rows, _cache_values(cache, k, v))


def written_cache(cache: torch.Tensor, rows: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """`write_cache` out of place: a new tensor, cache with k and v written (the named op's reference)."""
    S, L, _, C, D = cache.shape
    return cache.view(S * L * 2 * C, D).index_copy(0, rows, _cache_values(cache, k, v)).view(cache.shape)


def cache_attention(q: torch.Tensor, cache: torch.Tensor, layer: int, read_len: int, positions: torch.Tensor,
                    attention: str) -> torch.Tensor:
    """The attention of a block's queries over the first `read_len` rows of one layer of the KV cache.

    Args:
        q: [S, T, Hq, hd]; cache: [S, L, 2, C, Hkv * hd], this step's keys and values written
            (`write_cache`); positions: int64 [S, T], the queries' positions (key n is visible to
            query t when n <= positions[t]).
        attention: the form (`ATTENTION`) that computes it.

    Returns:
        [S, T, Hq * hd] in q's dtype. Exported, the named op `dflash::block_attention` on q, the
        whole cache and the layer (the block attention kernel reads the cache in place), with the
        form's result as its reference.
    """
    S, hkv, hd = cache.shape[0], cache.shape[-1] // q.shape[-1], q.shape[-1]
    keys = cache[:, layer, 0, :read_len].view(S, read_len, hkv, hd)
    values = cache[:, layer, 1, :read_len].view(S, read_len, hkv, hd)
    key_pos = torch.arange(read_len, dtype=torch.int64, device=positions.device)[None, None, :]
    visible = key_pos <= positions[:, :, None]
    out = attention_fn(attention)(q, keys, values, visible)
    if not ops.exporting():
        return out
    return ops.block_attention(q, cache, layer, query_rows_mask(visible, q.shape[2] // hkv), out)


class DecoderLayer(nn.Module):
    """Pre-norm Qwen3 decoder layer: x + attn(norm(x)), then x + mlp(norm(x)); the target's, and
    with another `forward` the drafter's (export/dflash.py `DrafterLayer`)."""

    def __init__(self, cfg: LayerShape, dtype=None, device=None, attention: str = "fused"):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)
        self.self_attn = Attention(cfg, dtype, device, attention)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)
        self.mlp = MLP(cfg, dtype, device)
        self.attention = attention

    def finish(self, x: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:
        """x + o_proj(attended), then that + mlp(norm(that)): x [S, T, hidden], attended [S, T, Hq * hd]."""
        x = project_residual(attended, self.self_attn.o_proj, x)
        return self.mlp.add_to(x, self.post_attention_layernorm(x))

    def forward(self, x, cos, sin, positions, cache: torch.Tensor | None, layer: int, read_len: int,
                rows: torch.Tensor | None) -> torch.Tensor:
        """rows: this layer's `cache_rows(cache, positions)[layer]` (None without a cache).

        Raises RuntimeError when exported in the "fused" form with a cache: that write is the
        result `step` returns, which this would drop; call `step` and thread the cache."""
        if cache is not None and self.attention == "fused" and ops.exporting():
            raise RuntimeError("DecoderLayer.forward would drop the exported KV cache write: use step()")
        return self.step(x, cos, sin, positions, cache, layer, read_len, rows)[0]

    def step(self, x, cos, sin, positions, cache: torch.Tensor | None, layer: int, read_len: int,
             rows: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`forward`, and the cache after this layer's write: `cache` itself, written in place, but for
        the GPU export (the "fused" form), whose write is a named op's result (`Attention.qkv_written`),
        so that the cache is a value threaded through the layers (`Qwen3.forward`)."""
        if cache is not None and self.attention == "fused" and ops.exporting():
            # the norms go with the GEMMs after them (named ops): decode's one row takes each norm in
            # its GEMM's prologue (export/lower_linear.py)
            q, cache = self.self_attn.qkv_written(x, cos, sin, cache, rows, self.input_layernorm)
            x = project_residual(cache_attention(q, cache, layer, read_len, positions, self.attention),
                                 self.self_attn.o_proj, x)
            return self.mlp.add_normed(x, self.post_attention_layernorm), cache
        h = self.input_layernorm(x)
        q, k, v = self.self_attn.qkv(h, cos, sin)
        if cache is None:  # training: attend within the block only
            visible = positions[:, None, :] <= positions[:, :, None]
            return self.finish(x, attention_fn(self.attention)(q, k, v, visible)), None
        write_cache(cache, rows, k, v)
        return self.finish(x, cache_attention(q, cache, layer, read_len, positions, self.attention)), cache


class Qwen3Body(nn.Module):
    """`model.*` of the HF checkpoint: embed_tokens, layers, norm."""

    def __init__(self, cfg: TargetConfig, dtype=None, device=None, attention: str = "fused"):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size, dtype=dtype, device=device)
        self.layers = nn.ModuleList(DecoderLayer(cfg, dtype, device, attention) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)


class Qwen3(nn.Module):
    """Qwen3 dense decoder with a static KV cache and drafter taps.

    Args:
        cfg: the target config.
        max_context: KV cache length in tokens (C).
        tap_layer_ids: decoder layers whose outputs feed the drafter, in the drafter's order.
        streams: leading stream dimension S of the cache (1 for now).
        dtype: parameter and cache dtype (torch.bfloat16, float16, float32).
        device: "meta" builds the structure without memory (export of large shapes).
        attention: "fused" (`attend`, and when exported the norm + rope and KV cache write custom op
            of `Attention.qkv_written`, for GPUs) or "matmul" (`attend_matmul`, for CPUs); the same
            function either way.
    """

    def __init__(self, cfg: TargetConfig, max_context: int, tap_layer_ids=(), streams: int = 1,
                 dtype=torch.float32, device=None, attention: str = "fused"):
        super().__init__()
        self.cfg = cfg
        self.max_context = max_context
        self.tap_layer_ids = tuple(tap_layer_ids)
        self.model = Qwen3Body(cfg, dtype, device, attention)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False, dtype=dtype, device=device)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        shape = (streams, cfg.num_hidden_layers, 2, max_context, cfg.kv_dim)
        self.register_buffer("kv_cache", torch.zeros(shape, dtype=dtype, device=device), persistent=False)

    @property
    def dtype(self) -> torch.dtype:
        """The compute dtype (the final norm's: a 4-bit lm_head's weight is packed integers)."""
        return self.model.norm.weight.dtype

    def forward(self, tokens: torch.Tensor, start: torch.Tensor, sampling: Sampling | None = None,
                read_len: int | None = None, use_cache: bool = True,
                last_only: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Run T new tokens per stream at positions [start, start + T), writing the KV cache.

        Args:
            tokens: int64 [S, T].
            start: int64 [S], absolute position of tokens[:, 0] (= committed length).
            sampling: None for greedy, else per-stream keyed sampling parameters.
            read_len: cache rows attention reads (>= start + T); default max_context.
            use_cache: False for training: no cache read or write, causal attention within the block.
            last_only: choose a token for the last row only (prefill): lm_head and the token choice
                skip the other rows, and chosen / logits have T = 1.

        Returns:
            chosen: int64 [S, T], the target's token after each row (for positions start+1 ..).
            logits: float32 [S, T, vocab_size].
            taps: [S, T, len(tap_layer_ids) * hidden_size] in the model dtype.
        """
        T = tokens.shape[1]
        read_len = self.max_context if read_len is None else read_len
        positions = start[:, None] + torch.arange(T, dtype=torch.int64, device=tokens.device)
        x = self.model.embed_tokens(tokens)
        cos, sin = rope_tables(positions, self.cfg.head_dim, self.cfg.rope_theta, x.dtype, self.cfg.yarn)
        taps = {}
        cache = self.kv_cache if use_cache else None
        rows = cache_rows(cache, positions) if use_cache else None
        for i, layer in enumerate(self.model.layers):
            x, cache = layer.step(x, cos, sin, positions, cache, i, read_len, None if rows is None else rows[i])
            if i in self.tap_layer_ids:
                taps[i] = x
        if cache is not None and cache is not self.kv_cache:  # the GPU export's threaded cache, stored once
            self.kv_cache.copy_(cache)
        h = self.model.norm(x)
        if self.cfg.num_hidden_layers - 1 in taps:
            # HF's hidden_states[L] is taken after the final norm; drafters are trained on it
            taps[self.cfg.num_hidden_layers - 1] = h
        tapped = torch.cat([taps[i] for i in self.tap_layer_ids], -1) if taps else x[..., :0]
        if last_only:
            h, positions = h[:, -1:], positions[:, -1:]
        logits = as_float32(project(h, [self.lm_head])[0])
        chosen = choose_tokens(logits, positions + 1, sampling)
        return chosen, logits, tapped
