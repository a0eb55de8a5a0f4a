"""The chunked Gated DeltaNet rule (prefill's form) against the token-by-token rule when a chunk's
keys are alike, as a trained model's are: export/gdn.py `unit_lower_inverse` must stay within float
rounding of forward substitution there. Random keys (nearly orthogonal at d_k = 64) hid the
power-series form's cancellation; the planted power series is kept here and must fail."""

from __future__ import annotations

import pytest
import torch

from dflash_iree.export import gdn


def _power_series_inverse(lower: torch.Tensor) -> torch.Tensor:
    """The planted control: (I - L)^-1 = (I + L)(I + L^2)(I + L^4)..., the form gdn.py had."""
    n = lower.shape[-1]
    eye = torch.eye(n, dtype=lower.dtype)
    out, power, span = eye + lower, lower, 2
    while span < n:
        power = power @ power
        out = out @ (eye + power)
        span *= 2
    return out


def _forward_substitution(lower: torch.Tensor) -> torch.Tensor:
    n = lower.shape[-1]
    eye = torch.eye(n, dtype=lower.dtype)
    rows = [eye[0].expand(*lower.shape[:-2], n)]
    for i in range(1, n):
        rows.append(eye[i] + (lower[..., i, :i, None] * torch.stack(rows, -2)).sum(-2))
    return torch.stack(rows, -2)


def _alike_inputs(correlation: float, T: int = 150, seed: int = 0):
    """Rule inputs (S 2, Hk 2, Hv 4, dk = dv 64) whose keys share a direction: k = c * u + (1 - c) * noise."""
    g = torch.Generator().manual_seed(seed)
    S, Hk, Hv, d = 2, 2, 4, 64
    shared = torch.randn(1, 1, 1, d, generator=g)
    k = correlation * shared + (1 - correlation) * torch.randn(S, T, Hk, d, generator=g)
    q = torch.randn(S, T, Hk, d, generator=g)
    v = torch.randn(S, T, Hv, d, generator=g)
    beta = torch.sigmoid(2 + torch.randn(S, T, Hv, generator=g))  # near 1: the hard case
    decay = -0.02 * torch.rand(S, T, Hv, generator=g)  # slow decay keeps the whole chunk coupled
    return gdn.prepare(q, k, v, beta, decay)


@pytest.mark.parametrize("correlation", [0.0, 0.5, 0.9, 0.99])
def test_inverse_equals_forward_substitution(correlation):
    q, k, v, beta, g = _alike_inputs(correlation, T=64)
    lower = -((k * beta[..., None]) @ k.transpose(-1, -2)).tril(-1)
    ref = _forward_substitution(lower)
    assert (gdn.unit_lower_inverse(lower) - ref).abs().max() < 1e-5


@pytest.mark.parametrize("correlation", [0.5, 0.9])
def test_chunked_rule_equals_token_by_token(correlation):
    inputs = _alike_inputs(correlation)
    state = torch.randn(2, 4, 64, 64, generator=torch.Generator().manual_seed(1)) * 0.1
    o_ref, states = gdn.recurrent_rule(*inputs, state)
    o, last = gdn.chunked_rule(*inputs, state)
    assert (o - o_ref).abs().max() < 1e-3 * o_ref.abs().max()
    assert (last - states[-1]).abs().max() < 1e-3 * states[-1].abs().max()


def test_planted_power_series_fails(monkeypatch):
    inputs = _alike_inputs(0.5)
    state = torch.zeros(2, 4, 64, 64)
    o_ref, _ = gdn.recurrent_rule(*inputs, state)
    monkeypatch.setattr(gdn, "unit_lower_inverse", _power_series_inverse)
    o, _ = gdn.chunked_rule(*inputs, state)
    assert not bool(((o - o_ref).abs().max() < 1e-3 * o_ref.abs().max()).item())
