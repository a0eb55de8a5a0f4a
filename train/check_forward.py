"""CPU check: the parallel training forward (drafter_forward.block_logits) equals the inference
forward (`DFlashDrafter.forward`, one block from the context cache) for every anchor.

    .venv/bin/python train/check_forward.py

Also checks that train/common.sdpa_attend equals export.qwen3.attend. Random demo-sized weights,
float32; exits non-zero on a mismatch.
"""

from __future__ import annotations

import sys

from common import init_weights, parse_configs, sdpa_attend

import torch

from dflash_iree.export.dflash import DFlashDrafter
from dflash_iree.export.qwen3 import Qwen3, attend
from drafter_forward import block_logits


def main() -> int:
    torch.manual_seed(0)
    ok = True
    # attention: SDPA replacement vs the module's own
    q, k, v = torch.randn(2, 5, 6, 64), torch.randn(2, 9, 2, 64), torch.randn(2, 9, 2, 64)
    visible = torch.rand(2, 5, 9) < 0.6
    visible[..., 0] = True
    err = (sdpa_attend(q, k, v, visible) - attend(q, k, v, visible)).abs().max().item()
    print(f"sdpa_attend vs attend: max abs diff {err:.2e}")
    ok &= err < 1e-4

    for B in (8, 16):
        tcfg, dcfg = parse_configs(B)
        L = 40
        target = Qwen3(tcfg, 64, dcfg.target_layer_ids)
        init_weights(target, tcfg.num_hidden_layers, std=0.1)
        drafter = DFlashDrafter(dcfg, 64, B)
        init_weights(drafter, dcfg.num_hidden_layers, std=0.1)
        for p in list(target.parameters()) + list(drafter.parameters()):
            if p.dim() == 1:  # norms away from 1 so they are tested too
                p.data.uniform_(0.5, 1.5)
        seq = torch.randint(2, tcfg.vocab_size, (1, L))
        with torch.no_grad():
            _, _, taps = target(seq, torch.zeros(1, dtype=torch.int64), use_cache=False)
            anchors = torch.tensor([[1, 5, 17, 30, 39]])
            par = block_logits(drafter, target, taps, seq, anchors, B)
            worst = 0.0
            for j, a in enumerate(anchors[0].tolist()):
                drafter.ctx_cache.zero_()
                _, ref = drafter(target, taps[:, :a], torch.zeros(1, dtype=torch.int64), torch.tensor([a]),
                                 seq[:, a], read_len=a + B)
                worst = max(worst, (par[:, j] - ref).abs().max().item() / ref.abs().max().item())
        print(f"block {B}: block_logits vs DFlashDrafter.forward, max relative diff {worst:.2e}")
        ok &= worst < 1e-4
    print("OK" if ok else "MISMATCH")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
