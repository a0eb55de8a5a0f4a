"""The Gated DeltaNet layer of Qwen3.5-family targets: eager reference and export source.

Authority: transformers 5.24.0 `models/qwen3_5/modular_qwen3_5.py` (`Qwen3_5GatedDeltaNet`) and
`models/qwen3_next/modeling_qwen3_next.py` (`torch_recurrent_gated_delta_rule`,
`torch_chunk_gated_delta_rule`, `Qwen3NextRMSNormGated`); the rule is Yang et al., "Gated Delta
Networks" (arXiv:2412.06464). Parameter names equal the checkpoint's (`in_proj_qkv`, `conv1d.weight`,
`A_log`, `dt_bias`, `norm.weight`, `out_proj`, ...).

Per layer and token t, with q, k L2-normalised (q also scaled by d_k^-1/2), the key heads repeated to
the value heads, and a float32 state S [Hv, dk, dv]:
    S <- exp(g_t) S;  S <- S + k_t (x) beta_t (v_t - S^T k_t);  o_t = S^T q_t,
with beta = sigmoid(b) and g = -exp(A_log) softplus(a + dt_bias). The output passes the gated
RMSNorm w * norm(o) * silu(z), then out_proj.

Two forms of the recurrence, one result up to float rounding:
- `recurrent_rule`, token by token: what decode and verify run, so that the state after a token is
  the same, bit for bit, whichever call saw it (row invariance), and each row's state is at hand
  for rollback (export/recurrent_state.py);
- `chunked_rule`, chunks of 64 with the intra-chunk triangular system inverted by recursive block
  inversion (`unit_lower_inverse`; exportable: no triangular solve, and log2(64) levels of matmuls
  where forward substitution unrolls 64): a long prefill's form eagerly and in IREE's lowering (the
  host), chosen by measurement (experiments/2026-12-02-gdn-forms/). On a GPU a prefill's rule is
  the GDN step kernel's token-by-token form instead, in blocks of 16 rows (export/qwen35.py
  `Qwen35.step`), also chosen by measurement (experiments/2026-12-06-gdn-warp/).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dflash_iree.config_qwen35 import HybridConfig

from .qwen3 import project

CHUNK = 64  # transformers' chunk_size


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x * rsqrt(sum(x^2) + eps) over the last dim (the FLA form transformers follows)."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def causal_conv(rows: torch.Tensor, window: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The causal depthwise conv1d + SiLU of T new rows after the K - 1 rows before them.

    Args:
        rows: [S, T, D], in_proj_qkv's output; window: [S, K - 1, D], the inputs before rows[:, 0]
            (zeros at the sequence start); weight: [D, K] (conv1d.weight[:, 0]).

    Returns:
        silu(conv) [S, T, D] in rows' dtype (out[t] = sum_k w[:, k] * x[t - K + 1 + k], summed
        k = 0.., the same order for every row), and the inputs [S, K - 1 + T, D], window then rows:
        the window after row t is their rows t + 1 .. t + K - 1.
    """
    K = weight.shape[1]
    T = rows.shape[1]
    full = torch.cat([window.to(rows.dtype), rows], 1)
    out = full[:, 0:T] * weight[:, 0]
    for k in range(1, K):
        out = out + full[:, k:k + T] * weight[:, k]
    return F.silu(out), full


def prepare(q, k, v, beta, g):
    """The rule's inputs in float32, heads first: q, k [S, T, Hk, dk] -> L2-normalised, repeated
    to Hv heads, q scaled by dk^-1/2, [S, Hv, T, dk]; v [S, T, Hv, dv] -> [S, Hv, T, dv];
    beta, g [S, T, Hv] -> [S, Hv, T]."""
    rep = v.shape[2] // k.shape[2]
    q, k = (x.repeat_interleave(rep, dim=2) if rep > 1 else x for x in (q, k))
    q, k, v, beta, g = (x.transpose(1, 2).float() for x in (q, k, v, beta, g))
    q, k = l2norm(q), l2norm(k)
    return q * (q.shape[-1] ** -0.5), k, v, beta, g


def delta_step(state: torch.Tensor, q, k, v, beta, g) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of the gated delta rule: state [S, Hv, dk, dv] f32; q, k [S, Hv, dk]; v [S, Hv, dv];
    beta, g [S, Hv]. Returns (o [S, Hv, dv], the new state)."""
    state = state * g.exp()[..., None, None]
    kv_mem = (state * k[..., None]).sum(-2)
    delta = (v - kv_mem) * beta[..., None]
    state = state + k[..., None] * delta[..., None, :]
    return (state * q[..., None]).sum(-2), state


def recurrent_rule(q, k, v, beta, g, state: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The rule token by token (`prepare`d inputs, state [S, Hv, dk, dv] f32 before the first).

    Returns o [S, Hv, T, dv] f32 and the state after each of the T tokens."""
    outs, states = [], []
    for t in range(q.shape[2]):
        o, state = delta_step(state, q[:, :, t], k[:, :, t], v[:, :, t], beta[:, :, t], g[:, :, t])
        outs.append(o)
        states.append(state)
    return torch.stack(outs, 2), states


def unit_lower_inverse(lower: torch.Tensor) -> torch.Tensor:
    """(I - L)^-1 for strictly lower triangular L [..., n, n] (n a power of two), by recursive block
    inversion: with the inverses X_A, X_D of two diagonal blocks of size s, the block of size 2s
    has the inverse [[X_A, 0], [X_D L_C X_A, X_D]] (L_C its lower-left block of L). With X_s the
    block-diagonal matrix of the size-s inverses and M_s the mask of those lower-left blocks, that
    is X_2s = X_s + X_s (L * M_s) X_s: log2(n) levels of two matmuls each on the whole matrix
    (the zero blocks add exact zeros), where forward substitution takes n dependent row steps (each
    an op of its own in an unrolled static graph: 6.6k dispatches a 64-row prefill on the host).

    Why not the power series I + L + L^2 + ... by doubling, which this replaced: its terms grow
    like binomials when a chunk's keys are alike (trained models' are) and cancel to an O(1)
    inverse, so float32 lost everything: 7.7e3 off at key correlation 0.5 where this form is
    within float rounding of forward substitution (tests/test_gdn_inverse.py)."""
    n = lower.shape[-1]
    i = torch.arange(n, device=lower.device)
    inv = torch.eye(n, dtype=lower.dtype, device=lower.device)
    s = 1
    while s < n:
        # logical_and, not `&`: torch-mlir in IREE 3.13 has no aten.__and__
        lower_left = torch.logical_and(torch.logical_and((i[:, None] // (2 * s)) == (i[None, :] // (2 * s)),
                                                         (i[:, None] // s) % 2 == 1), (i[None, :] // s) % 2 == 0)
        inv = inv + inv @ (lower * lower_left.to(lower.dtype)) @ inv
        s *= 2
    return inv


def chunked_rule(q, k, v, beta, g, state: torch.Tensor, chunk: int = CHUNK) -> tuple[torch.Tensor, torch.Tensor]:
    """The rule over chunks of `chunk` tokens (`prepare`d inputs), as transformers'
    `torch_chunk_gated_delta_rule` (the "UT transform" of DeltaNet, arXiv:2406.06484), with the unit
    lower triangular system of each chunk inverted by recursive block inversion
    (`unit_lower_inverse`) where transformers' export branch runs forward substitution.

    Returns o [S, Hv, T, dv] f32 and the state after the last token.
    """
    T = q.shape[2]
    pad = (chunk - T % chunk) % chunk
    q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
    beta, g = (F.pad(x, (0, pad)) for x in (beta, g))
    S, H, N, dk = k.shape
    n = N // chunk
    v_beta, k_beta = v * beta[..., None], k * beta[..., None]
    q, k, k_beta, v_beta = (x.reshape(S, H, n, chunk, x.shape[-1]) for x in (q, k, k_beta, v_beta))
    decay = g.reshape(S, H, n, chunk).cumsum(-1)
    upper = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).triu(1)
    pair = (decay[..., :, None] - decay[..., None, :]).masked_fill(upper, float("-inf")).exp()
    strictly_lower = upper.T
    system = -((k_beta @ k.transpose(-1, -2)) * pair).masked_fill(~strictly_lower, 0.0)
    inv = unit_lower_inverse(system)
    new_v, k_decay = inv @ v_beta, inv @ (k_beta * decay.exp()[..., None])
    intra = ((q @ k.transpose(-1, -2)) * pair).masked_fill(upper, 0.0)
    q = q * decay.exp()[..., None]
    k = k * (decay[..., -1:] - decay).exp()[..., None]
    out = []
    for i in range(n):
        v_new = new_v[:, :, i] - k_decay[:, :, i] @ state
        out.append(q[:, :, i] @ state + intra[:, :, i] @ v_new)
        state = state * decay[:, :, i, -1].exp()[..., None, None] + k[:, :, i].transpose(-1, -2) @ v_new
    return torch.cat(out, 2)[:, :, :T], state


def gated_rms_norm(o: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """w * norm(o) * silu(z) per head, as `Qwen3NextRMSNormGated`: o, z [..., dv] (o f32 or the
    model dtype), weight [dv] (not zero-centred). Returns z's dtype."""
    dtype = z.dtype
    o32 = o.float()
    o32 = o32 * torch.rsqrt(o32.pow(2).mean(-1, keepdim=True) + eps)
    return (weight * o32.to(dtype) * F.silu(z.float())).to(dtype)


class GatedRMSNorm(nn.Module):
    """`gated_rms_norm` with its weight [dv]."""

    def __init__(self, dim: int, eps: float, dtype=None, device=None):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype, device=device))
        self.eps = eps

    def forward(self, o: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        return gated_rms_norm(o, z, self.weight, self.eps)


class GatedDeltaNet(nn.Module):
    """`linear_attn` of a Qwen3.5 layer: projections, conv, the gated delta rule, gated norm.

    `forward` returns the mixer's output before out_proj (the layer adds out_proj and the residual
    as one named op) and the states the caller keeps (export/recurrent_state.py)."""

    def __init__(self, cfg: HybridConfig, dtype=None, device=None):
        super().__init__()
        kw = dict(bias=False, dtype=dtype, device=device)
        H = cfg.hidden_size
        self.cfg = cfg
        self.in_proj_qkv = nn.Linear(H, cfg.conv_dim, **kw)
        self.in_proj_z = nn.Linear(H, cfg.value_dim, **kw)
        self.in_proj_b = nn.Linear(H, cfg.linear_num_value_heads, **kw)
        self.in_proj_a = nn.Linear(H, cfg.linear_num_value_heads, **kw)
        self.conv1d = nn.Conv1d(cfg.conv_dim, cfg.conv_dim, cfg.linear_conv_kernel_dim, groups=cfg.conv_dim,
                                bias=False, dtype=dtype, device=device)
        self.dt_bias = nn.Parameter(torch.ones(cfg.linear_num_value_heads, dtype=dtype, device=device))
        self.A_log = nn.Parameter(torch.zeros(cfg.linear_num_value_heads, dtype=dtype, device=device))
        self.norm = GatedRMSNorm(cfg.linear_value_head_dim, cfg.rms_norm_eps, dtype, device)
        self.out_proj = nn.Linear(cfg.value_dim, H, **kw)

    def forward(self, x: torch.Tensor, state: torch.Tensor, window: torch.Tensor, per_token: bool, rule=None):
        """Mix T rows.

        Args:
            x: [S, T, hidden], the normed layer input.
            state: [S, Hv, dk, dv] f32, the state before x[:, 0]; window: [S, K - 1, conv_dim], the
                conv inputs before it.
            per_token: the token-by-token rule (decode, verify: every row's state returned) or,
                False, `chunked_rule` (prefill: the last state only).
            rule: None, or (export only) rule(mixed, b, a, o, states) -> o: the named op
                `dflash::gated_delta_rule` (export/qwen35.py `Qwen35.step`) given the rule's inputs
                (the conv's output, in_proj_b's and in_proj_a's) and the reference results (o
                [S, T, Hv, dv] in x's dtype, the states), whose o goes on to the gated norm.

        Returns:
            y [S, T, value_dim] in x's dtype (the gated norm's output, out_proj's input); the
            states [S, Hv, dk, dv] after each row (per_token) or after the last row only (a list of
            T or 1); the conv windows after the same rows, [S, T or 1, K - 1, conv_dim] in x's dtype.
        """
        c = self.cfg
        S, T, _ = x.shape
        mixed, z, b, a = project(x, (self.in_proj_qkv, self.in_proj_z, self.in_proj_b, self.in_proj_a))
        mixed, inputs = causal_conv(mixed, window, self.conv1d.weight[:, 0])
        K = self.cfg.linear_conv_kernel_dim
        # every row's window in one gather: a list of T slices became a copy each (48 x 16 a 27B verify)
        if per_token:
            at = torch.arange(T, device=x.device)[:, None] + torch.arange(1, K, device=x.device)[None]
            windows = inputs[:, at]
        else:
            windows = inputs[:, None, T:]
        q, k, v = torch.split(mixed, [c.key_dim, c.key_dim, c.value_dim], -1)
        q = q.reshape(S, T, c.linear_num_key_heads, c.linear_key_head_dim)
        k = k.reshape(S, T, c.linear_num_key_heads, c.linear_key_head_dim)
        v = v.reshape(S, T, c.linear_num_value_heads, c.linear_value_head_dim)
        beta = b.sigmoid()
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)
        rule_inputs = prepare(q, k, v, beta, g)
        if per_token:
            o, states = recurrent_rule(*rule_inputs, state)
        else:
            o, last = chunked_rule(*rule_inputs, state)
            states = [last]
        o = o.transpose(1, 2).to(x.dtype)  # S, T, Hv, dv
        if rule is not None:
            o = rule(mixed, b, a, o, states)
        y = self.norm(o, z.reshape(S, T, c.linear_num_value_heads, c.linear_value_head_dim))
        return y.reshape(S, T, c.value_dim), states, windows
