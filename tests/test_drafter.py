"""The DFlash drafter: its cached rounds against a from-scratch forward written the reference way.

The reference way (z-lab/dflash `Qwen3DFlashAttention`): in every layer, k/v of the fused context
and of the block are concatenated, k_norm and RoPE applied at absolute positions, and the block's
queries attend to all of it with no mask.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dflash_iree.export.load import load_pair


def _rms(x, w, eps=1e-6):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _rope(x, pos, theta=10000.0):
    hd = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd)
    f = pos[:, None].float() * inv
    cos, sin = torch.cat([f, f], -1).cos(), torch.cat([f, f], -1).sin()
    x1, x2 = x[..., : hd // 2], x[..., hd // 2:]
    return x * cos[:, None] + torch.cat([-x2, x1], -1) * sin[:, None]


@torch.no_grad()
def reference_draft(target, drafter, ctx_taps, anchor, mask_id):
    """Draft logits from scratch: ctx_taps [P, nH] at positions 0..P-1, block at P..P+B-1."""
    P, B, hd = ctx_taps.shape[0], drafter.block_size, drafter.cfg.head_dim
    ctx = _rms(ctx_taps @ drafter.fc.weight.T, drafter.hidden_norm.weight)
    x = target.model.embed_tokens.weight[torch.tensor([anchor] + [mask_id] * (B - 1))]
    pos = torch.arange(P + B)
    for layer in drafter.layers:
        a = layer.self_attn
        h = _rms(x, layer.input_layernorm.weight)
        q = _rope(_rms((h @ a.q_proj.weight.T).view(B, -1, hd), a.q_norm.weight), pos[P:])
        kv_in = torch.cat([ctx, h])
        k = _rope(_rms((kv_in @ a.k_proj.weight.T).view(P + B, -1, hd), a.k_norm.weight), pos)
        v = (kv_in @ a.v_proj.weight.T).view(P + B, -1, hd)
        g = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
        o = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1))
        x = x + o.transpose(0, 1).reshape(B, -1) @ a.o_proj.weight.T
        h = _rms(x, layer.post_attention_layernorm.weight)
        m = layer.mlp
        x = x + (F.silu(h @ m.gate_proj.weight.T) * (h @ m.up_proj.weight.T)) @ m.down_proj.weight.T
    return _rms(x[1:], drafter.norm.weight) @ target.lm_head.weight.T


@torch.no_grad()
def test_rounds_match_from_scratch(target_dir, drafter_dir):
    """Absorb the prompt, then two rounds of committed rows, against one from-scratch forward."""
    target, drafter = load_pair(target_dir, drafter_dir, 128)
    tokens = torch.randint(0, 512, (1, 30), generator=torch.Generator().manual_seed(0))
    _, _, taps = target(tokens, torch.tensor([0]))
    drafter.absorb(taps[:, :17], torch.tensor([0]))
    drafter(target, taps[:, 17:20], torch.tensor([17]), torch.tensor([3]), tokens[:, 20])  # round 1
    draft, logits = drafter(target, taps[:, 20:25], torch.tensor([20]), torch.tensor([5]), tokens[:, 25])
    ref = reference_draft(target, drafter, taps[0, :25], int(tokens[0, 25]), 511)
    assert (logits[0] - ref).abs().max().item() < 1e-4
    assert torch.equal(draft[0], ref.argmax(-1))


@torch.no_grad()
def test_padding_rows_are_ignored(target_dir, drafter_dir):
    """Rows past n_valid (fixed-shape padding in compiled graphs) change nothing."""
    target, drafter = load_pair(target_dir, drafter_dir, 128)
    tokens = torch.randint(0, 512, (1, 20), generator=torch.Generator().manual_seed(1))
    _, _, taps = target(tokens, torch.tensor([0]))
    drafter.absorb(taps[:, :10], torch.tensor([0]))
    _, exact = drafter(target, taps[:, 10:13], torch.tensor([10]), torch.tensor([3]), tokens[:, 13])
    padded = torch.cat([taps[:, 10:13], torch.randn(1, 5, taps.shape[-1]) * 100], 1)
    drafter.absorb(taps[:, :10], torch.tensor([0]))
    _, logits = drafter(target, padded, torch.tensor([10]), torch.tensor([3]), tokens[:, 13], read_len=24)
    assert (logits - exact).abs().max().item() < 1e-5


@torch.no_grad()
def test_block_size_below_trained(target_dir, drafter_dir):
    target, drafter = load_pair(target_dir, drafter_dir, 64, block_size=4)
    _, _, taps = target(torch.arange(6)[None], torch.tensor([0]))
    draft, logits = drafter(target, taps, torch.tensor([0]), torch.tensor([6]), torch.tensor([7]))
    assert draft.shape == (1, 3) and logits.shape == (1, 3, 512)
