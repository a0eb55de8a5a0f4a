"""The DFlash drafter's training forward: many blocks at random anchors in parallel, and its loss.

`DFlashDrafter.forward` drafts one block per stream from a context cache (inference). Training
runs A blocks per sequence at once from the same submodules (fc, hidden_norm, layers[i].*, norm):
- the context is the fused taps of every position, `hidden_norm(fc(taps))` [S, L, H], projected
  per layer with that layer's k_proj / v_proj (+ k_norm, RoPE at positions 0..L-1), exactly as
  `absorb` writes the inference cache;
- block j is [seq[a_j], MASK x (B - 1)] at positions a_j .. a_j + B - 1; its queries see the
  context at positions < a_j (strictly before the anchor: the anchor's own taps are not known at
  inference) and the B positions of block j bidirectionally, never other blocks;
- logits are read at block positions 1..B-1 through the target's lm_head.
`check_forward.py` checks this against `DFlashDrafter.forward`, block by block, on the CPU.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dflash_iree.export import qwen3 as qwen3_module
from dflash_iree.export.dflash import DFlashDrafter
from dflash_iree.export.qwen3 import Qwen3, rope_tables


def block_inputs(drafter, target: Qwen3, taps: torch.Tensor, seq: torch.Tensor, anchors: torch.Tensor,
                 block_size: int):
    """What both training forwards (`block_logits`, drafter2_forward.py's `block_logits2`) start from.

    Args: as `block_logits`.

    Returns:
        ctx [S, L, H] (hidden_norm(fc(taps))), its RoPE tables cos_c, sin_c [S, L, hd]; x [S, A*B, H],
        the blocks' embeddings ([seq[a_j], MASK x (B - 1)], scaled), their tables cos_b, sin_b
        [S, A*B, hd]; visible: bool [S, A*B, L + A*B], which context and block keys each row sees.
    """
    cfg = drafter.cfg
    S, L = seq.shape
    A, B, dev = anchors.shape[1], block_size, seq.device
    wdtype = drafter.fc.weight.dtype
    ctx = drafter.hidden_norm(drafter.fc(taps.to(wdtype)))  # S, L, H
    ctx_pos = torch.arange(L, device=dev).expand(S, L)
    cos_c, sin_c = rope_tables(ctx_pos, cfg.head_dim, cfg.rope_theta, ctx.dtype, cfg.yarn)

    pos = (anchors[..., None] + torch.arange(B, device=dev)).reshape(S, A * B)
    block = torch.full((S, A, B), cfg.mask_token_id, dtype=torch.int64, device=dev)
    block[..., 0] = seq.gather(1, anchors)
    x = (target.model.embed_tokens(block.reshape(S, A * B)) * cfg.input_embedding_scale).to(wdtype)
    cos_b, sin_b = rope_tables(pos, cfg.head_dim, cfg.rope_theta, x.dtype, cfg.yarn)

    row_anchor = anchors.repeat_interleave(B, dim=1)  # S, A*B
    ctx_visible = ctx_pos[:, None, :] < row_anchor[:, :, None]  # S, A*B, L
    blk = torch.arange(A, device=dev).repeat_interleave(B)
    blk_visible = (blk[:, None] == blk[None, :]).expand(S, -1, -1)  # S, A*B, A*B
    visible = torch.cat([ctx_visible, blk_visible], -1)
    return ctx, cos_c, sin_c, x, cos_b, sin_b, visible


def block_logits(drafter: DFlashDrafter, target: Qwen3, taps: torch.Tensor, seq: torch.Tensor,
                 anchors: torch.Tensor, block_size: int) -> torch.Tensor:
    """Draft logits for A blocks per sequence.

    Args:
        drafter: the drafter (its cfg, fc, hidden_norm, layers, norm are used; not its cache).
        target: supplies embed_tokens and lm_head (frozen).
        taps: [S, L, n_taps * hidden], the target's taps at positions 0..L-1.
        seq: int64 [S, L], the token ids (block anchors are read from it).
        anchors: int64 [S, A], anchor positions, each in 1..L-1.
        block_size: B.

    Returns:
        float32 [S, A, B - 1, vocab]: logits for positions anchor + 1 .. anchor + B - 1.
    """
    S, A, B = seq.shape[0], anchors.shape[1], block_size
    ctx, cos_c, sin_c, x, cos_b, sin_b, visible = block_inputs(drafter, target, taps, seq, anchors, B)

    for layer in drafter.layers:
        ctx_k, ctx_v = layer.self_attn.key_value(ctx, cos_c, sin_c)
        h = layer.input_layernorm(x)
        q = layer.self_attn.query(h, cos_b, sin_b)
        k, v = layer.self_attn.key_value(h, cos_b, sin_b)
        # looked up at call time, so train/common.use_sdpa can swap in the fused kernel
        att = qwen3_module.attend(q, torch.cat([ctx_k, k], 1), torch.cat([ctx_v, v], 1), visible)
        x = x + layer.self_attn.o_proj(att)
        x = x + layer.mlp(layer.post_attention_layernorm(x))
    h = drafter.norm(x.view(S, A, B, -1)[:, :, 1:])
    return target.lm_head(h.to(target.dtype)).float()


def position_weights(block_size: int, gamma: float, device=None) -> torch.Tensor:
    """float32 [B - 1]: exp(-(k - 1) / gamma) for block position k = 1..B-1.

    Early positions count most: a draft token is only useful if every one before it was accepted.
    """
    k = torch.arange(1, block_size, dtype=torch.float32, device=device)
    return torch.exp(-(k - 1) / gamma)


def block_loss(logits: torch.Tensor, seq: torch.Tensor, anchors: torch.Tensor, valid_len: torch.Tensor,
               gamma: float, soft: torch.Tensor | None = None, soft_weight: float = 0.0) -> tuple[torch.Tensor, dict]:
    """Position-weighted cross-entropy of the drafts against the sequence's own next tokens and,
    with `soft_weight` > 0, against the target's distribution of each of those tokens.

    Args:
        logits: float32 [S, A, B - 1, V] from block_logits.
        seq: int64 [S, L]; valid_len: int64 [S], labels at positions >= valid_len are ignored.
        anchors: int64 [S, A].
        gamma: decay of the position weights.
        soft: float32 [S, A, B - 1, V], the target's logits for the same positions (T = 1), or None.
        soft_weight: loss = (1 - w) * CE(labels) + w * CE(softmax(soft)): distillation of the
            target's distribution (DistillSpec, Zhou et al. 2023), what a drafter needs to propose
            the target's own *sample* with shared noise (coupled drafting, export/sampling.py).

    Returns:
        loss (scalar), and stats as device tensors: "acc" [B - 1], per-position accuracy, and
        "tau", the acceptance length the greedy drafts would get against these labels (bonus
        token counted, mean over blocks whose labels all exist).
    """
    S, A, Bm1, V = logits.shape
    L = seq.shape[1]
    pos = anchors[..., None] + torch.arange(1, Bm1 + 1, device=seq.device)  # S, A, B-1
    valid = pos < valid_len[:, None, None]
    labels = seq.gather(1, pos.clamp(max=L - 1).reshape(S, -1)).view(S, A, Bm1)
    ce = F.cross_entropy(logits.reshape(-1, V), labels.reshape(-1), reduction="none").view(S, A, Bm1)
    if soft is not None and soft_weight > 0:
        soft_ce = -(torch.softmax(soft, -1) * torch.log_softmax(logits, -1)).sum(-1)
        ce = (1 - soft_weight) * ce + soft_weight * soft_ce
    w = position_weights(Bm1 + 1, gamma, seq.device) * valid
    loss = (ce * w).sum() / w.sum().clamp(min=1e-6)
    with torch.no_grad():  # stays on the device: no sync per step
        correct = (logits.argmax(-1) == labels) & valid
        acc = correct.float().sum((0, 1)) / valid.float().sum((0, 1)).clamp(min=1)
        full = valid.all(-1)  # blocks whose labels all exist: τ is defined for them
        run = torch.cumprod(correct.long(), -1).sum(-1).float() + 1
        tau = (run * full).sum() / full.sum()  # nan when no block is full
    return loss, {"acc": acc, "tau": tau}
