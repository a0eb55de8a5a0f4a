"""The DFlash2 drafter's training forward and its selector loss (train/drafter_forward.py's, plus
the convolutions and the candidate selector of export/dflash2.py).

`block_logits2` runs A blocks per sequence at once as `block_logits` does; in every layer the two
convolutions run over each block's own B rows (the rows of block j never see block j - 1's: each
block starts at its boundary, as at inference), around the attention and the MLP as in
`DFlash2Layer.forward`. `check_forward2.py` checks it against `DFlash2Drafter.forward` on the CPU.

`selector_loss` trains the walk's pair term by teacher forcing: at slot i the predecessor is the
sequence's true token before it (the anchor at slot 0), and the cross-entropy is taken over the
slot's top-K candidate scores (logit + <A[prev] * h', B[cand]>) against the true token, where it is
among them. The published DFlash2 training recipe is not public in the sources read
(next-families.md §1), so this loss is our choice: it is what the greedy walk needs when every
earlier draft was right, which is the only case in which a later draft can be accepted.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dflash_iree.export import qwen3 as qwen3_module
from dflash_iree.export.dflash2 import DFlash2Drafter
from dflash_iree.export.qwen3 import Qwen3

from drafter_forward import block_inputs, position_weights


def _per_block(conv_fn, x: torch.Tensor, A: int, B: int, *args):
    """Run a conv side on x [S, A * B, H] block by block ([S * A, B, H])."""
    S, _, H = x.shape
    flat = [a.reshape(S * A, B, *a.shape[2:]) for a in args]
    out = conv_fn(x.reshape(S * A, B, H), *flat)
    if isinstance(out, tuple):
        return out[0].reshape(S, A * B, H), out[1].reshape(S, A * B, *out[1].shape[2:])
    return out.reshape(S, A * B, H)


def block_logits2(drafter: DFlash2Drafter, target: Qwen3, taps: torch.Tensor, seq: torch.Tensor,
                  anchors: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Draft logits and the normalised hidden states for A blocks per sequence.

    Args: as `drafter_forward.block_logits`.

    Returns:
        logits: float32 [S, A, B - 1, V] (after the config's logit transform);
        h: [S, A, B - 1, hidden], the drafter's normalised output at those slots (the selector's input).
    """
    from dflash_iree.export.dflash import transform_logits

    S, A, B = seq.shape[0], anchors.shape[1], block_size
    ctx, cos_c, sin_c, x, cos_b, sin_b, visible = block_inputs(drafter, target, taps, seq, anchors, B)
    for layer in drafter.layers:
        ctx_k, ctx_v = layer.self_attn.key_value(ctx, cos_c, sin_c)  # context rows: no convolution
        h, delta = _per_block(layer.attention_conv.prepare, layer.input_layernorm(x), A, B)
        q = layer.self_attn.query(h, cos_b, sin_b)
        k, v = layer.self_attn.key_value(h, cos_b, sin_b)
        att = qwen3_module.attend(q, torch.cat([ctx_k, k], 1), torch.cat([ctx_v, v], 1), visible)
        x = x + _per_block(layer.attention_conv.finish, layer.self_attn.o_proj(att), A, B, delta)
        h, delta = _per_block(layer.mlp_conv.prepare, layer.post_attention_layernorm(x), A, B)
        x = x + _per_block(layer.mlp_conv.finish, layer.mlp(h), A, B, delta)
    h = drafter.norm(x.view(S, A, B, -1)[:, :, 1:])
    return transform_logits(target.lm_head(h.to(target.dtype)).float(), drafter.cfg), h


def selector_loss(drafter: DFlash2Drafter, logits: torch.Tensor, h: torch.Tensor, seq: torch.Tensor,
                  anchors: torch.Tensor, valid_len: torch.Tensor, gamma: float) -> tuple[torch.Tensor, dict]:
    """Position-weighted cross-entropy of the teacher-forced walk's scores over the top-K candidates.

    Args:
        logits, h: `block_logits2`'s; seq: int64 [S, L]; anchors: int64 [S, A]; valid_len: int64 [S];
        gamma: the position weights' decay (drafter_forward.position_weights).

    Returns:
        loss (scalar; slots whose true token is not among the candidates, or past valid_len, count
        nothing), and stats: "covered", the fraction of valid slots whose true token is a
        candidate, and "walk_acc" [B - 1], the teacher-forced walk's accuracy per slot.
    """
    sel = drafter.candidate_selector
    S, A, Bm1, V = logits.shape
    L = seq.shape[1]
    pos = anchors[..., None] + torch.arange(0, Bm1 + 1, device=seq.device)  # the anchor, then the slots
    tokens = seq.gather(1, pos.clamp(max=L - 1).reshape(S, -1)).view(S, A, Bm1 + 1)
    prev, labels = tokens[..., :-1], tokens[..., 1:]
    valid = pos[..., 1:] < valid_len[:, None, None]
    cand = torch.topk(logits.detach(), sel.top_k, dim=-1).indices  # S, A, B-1, K (sorted, best first)
    unary = logits.gather(-1, cand)
    hp = sel.hidden_projection(h.to(sel.hidden_projection.weight.dtype)).float()
    query = F.embedding(prev, sel.predecessor_codebook).float() * hp  # S, A, B-1, r
    scores = unary + torch.einsum("sabr,sabkr->sabk", query, F.embedding(cand, sel.successor_codebook).float())
    hit = cand == labels[..., None]
    covered = hit.any(-1) & valid
    target_k = hit.float().argmax(-1)
    ce = F.cross_entropy(scores.reshape(-1, sel.top_k), target_k.reshape(-1), reduction="none").view(S, A, Bm1)
    w = position_weights(Bm1 + 1, gamma, seq.device) * covered
    loss = (ce * w).sum() / w.sum().clamp(min=1e-6)
    with torch.no_grad():
        right = (cand.gather(-1, scores.argmax(-1, keepdim=True))[..., 0] == labels) & valid
        stats = {"covered": covered.float().sum() / valid.float().sum().clamp(min=1),
                 "walk_acc": right.float().sum((0, 1)) / valid.float().sum((0, 1)).clamp(min=1)}
    return loss, stats
