"""CPU check: the DFlash2 training forward (drafter2_forward.block_logits2) equals the inference
forward (`DFlash2Drafter.forward`, one block from the context cache) for every anchor, and the
selector loss runs and has gradients for the codebooks. Random tiny weights (tests/tiny.py).

usage: python train/check_forward2.py
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from drafter2_forward import block_logits2, selector_loss  # noqa: E402


def main() -> None:
    from tiny import make_dflash2_drafter, make_target

    from dflash_iree.export.load import load_pair

    d = Path(tempfile.mkdtemp())
    t = make_target(d / "target")
    target, drafter = load_pair(t, make_dflash2_drafter(d / "drafter2", t), 64)
    B, L = drafter.block_size, 40
    seq = torch.randint(0, 511, (2, L), generator=torch.Generator().manual_seed(0))
    anchors = torch.tensor([[3, 17, 30], [1, 9, 25]])
    with torch.no_grad():
        _, _, taps = target(seq, torch.zeros(2, dtype=torch.int64), use_cache=False)
        par, _ = block_logits2(drafter, target, taps, seq, anchors, B)
    worst = 0.0
    for s in range(2):
        for j, a in enumerate(anchors[s].tolist()):
            with torch.no_grad():
                drafter.ctx_cache.zero_()
                _, one = drafter(target, taps[s:s + 1, :a], torch.tensor([0]), torch.tensor([a]), seq[s:s + 1, a],
                                 read_len=a + B)
            worst = max(worst, ((par[s, j] - one[0]).abs().max() / one.abs().max()).item())
    print(f"block {B}: block_logits2 vs DFlash2Drafter.forward, max relative diff {worst:.2e}")
    assert worst < 1e-4
    for p in drafter.parameters():
        p.requires_grad_(True)
    logits, h = block_logits2(drafter, target, taps, seq, anchors, B)
    loss, stats = selector_loss(drafter, logits, h, seq, anchors, torch.tensor([L, L]), 4.0)
    loss.backward()
    grad = drafter.candidate_selector.predecessor_codebook.grad
    print(f"selector loss {loss.item():.3f}, covered {stats['covered'].item():.3f}, codebook grad "
          f"{'present' if grad is not None and grad.abs().sum() > 0 else 'MISSING'}")


if __name__ == "__main__":
    main()
