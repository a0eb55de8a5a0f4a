"""Custom torch ops of the export, each replaced by a hand-written dispatch when compiled.

An op here has an eager implementation (what the nn.Modules run, so the eager modules stay the
reference) and a fake one (shapes and dtypes only, for tracing on the meta device). torch.export
keeps it as one node, the FX importer writes it as `torch.operator "torch.dflash.<name>"`, and
export/splice.py replaces it per arch with the dispatch of kernels/.

- `dflash::topk_logprobs(logits, temperature, k)`: the draft top-K (kernels/topk.py).
- `dflash::head_norm_rope(x, weight, cos, sin, eps)`: Qwen3's per-head q_norm / k_norm and RoPE
  (kernels/norm_rope.py), in the exported GPU form only (export/qwen3.py `norm_rope`).
"""

from __future__ import annotations

import torch

from dflash_iree.kernels.topk import MAX_K


@torch.library.custom_op("dflash::topk_logprobs", mutates_args=())
def topk_logprobs(logits: torch.Tensor, temperature: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The k best ids of each row and their log-probabilities: what kernels/topk.py computes.

    Args:
        logits: float32 [n, V].
        temperature: float32 [] (a 0-d tensor), > 0.
        k: 1..min(64, V).

    Returns:
        ids: int32 [n, k], by descending logit, equal logits by lower id (kernels/reference.py).
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


def top_k_per_stream(logits: torch.Tensor, temperature: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`topk_logprobs` for every stream: logits float32 [S, n, V], temperature float32 [S] (> 0).

    Returns ids int32 [S, n, k] and log-probs float32 [S, n, k] (one op, one dispatch, per stream:
    the kernel takes one temperature).
    """
    rows = [topk_logprobs(logits[s], temperature[s], k) for s in range(logits.shape[0])]
    return torch.stack([r[0] for r in rows]), torch.stack([r[1] for r in rows])


@torch.library.custom_op("dflash::head_norm_rope", mutates_args=())
def head_norm_rope(x: torch.Tensor, weight: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   eps: float) -> torch.Tensor:
    """`apply_rope(rms_norm(x, weight, eps), cos, sin)` of export/qwen3.py, as one op.

    Args:
        x: [S, T, H, hd]; weight: [hd]; cos, sin: [S, T, hd]; all of one dtype (f32, bf16, f16).
        eps: the RMSNorm epsilon.

    Returns:
        [S, T, H, hd] in x's dtype.
    """
    from .qwen3 import apply_rope, rms_norm  # qwen3 imports this module

    return apply_rope(rms_norm(x, weight, eps), cos, sin)


@head_norm_rope.register_fake
def _head_norm_rope_fake(x, weight, cos, sin, eps):
    return torch.empty_like(x)
