"""Row invariance, checked directly (issue #24): a target exported with debug functions that return
what the production entry points keep on the device, and the comparison of decode's row with
verify's row for the same position.

`export_row_module` exports a Qwen3 target (every layer tapped) with `prefill` and four debug
functions, `decode_logits`/`verify_logits` (float32 logits [1, T, V] and every layer's output
[1, T, L * H], bf16) and `decode_chosen`/`verify_chosen` (the greedy tokens alone, the production
graph's tail, where the argmax reads the logits in the same dispatch), of a decode (tokens [1, 1])
and a verify (tokens [1, B]). `compare_rows` runs them on a compiled module: a prefill, one verify
of a block, then decode j at the same positions, and counts the elements where decode j and verify
row j differ. tests/test_row_invariance.py runs it on the host; bench/row_invariance_check.py on a GPU.

The export side needs torch; `compare_rows` and `parts` need only numpy (and the functions passed in).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

DEBUG_FUNCTIONS = ("prefill", "decode_logits", "verify_logits", "decode_chosen", "verify_chosen")


def _logits_and_layers(m, tokens, start, pages):
    from .entry_points import _read_len

    _, logits, taps = m.target(tokens, start, None, read_len=_read_len(pages))
    return logits, taps


def _chosen(m, tokens, start, pages):
    from .entry_points import _read_len

    return m.target(tokens, start, None, read_len=_read_len(pages))[0]


def export_row_module(target_dir: Path, drafter_dir: Path, mlir: Path, block: int, context: int,
                      attention: str) -> tuple[int, int, int]:
    """Export the target of TARGET_DIR (config only, and a 4-bit checkpoint's safetensors headers: built on
    the meta device, its packed layers as the checkpoint stores them) with `prefill` and the
    debug functions (module docstring) for verify blocks of BLOCK rows and a cache of CONTEXT rows, in
    the attention form ATTENTION ("fused" for GPUs, "matmul" for the host), to MLIR file MLIR (not
    spliced). The drafter of DRAFTER_DIR is only the pair's other half: no drafter function is exported.

    Returns (layers L, hidden H, vocab V). Raises DFlashError for a config the loaders refuse.
    """
    import torch

    from dflash_iree.config import load_drafter_config, load_target_config

    from . import aot, entry_points as ep
    from .dflash import DFlashDrafter
    from .qwen3 import Qwen3

    tcfg = load_target_config(target_dir)
    dcfg = load_drafter_config(drafter_dir, tcfg)
    L, H, V = tcfg.num_hidden_layers, tcfg.hidden_size, tcfg.vocab_size
    from .load import read_quantized, tie_embeddings

    with torch.device("meta"):
        target = Qwen3(tcfg, context, tuple(range(L)), 1, torch.bfloat16, attention=attention)
        drafter = DFlashDrafter(dcfg, context, block, 1, torch.bfloat16, attention=attention)
    target = tie_embeddings(read_quantized(target, target_dir, torch.bfloat16))  # a 4-bit checkpoint: packed
    pair = aot.Pair(target, drafter).eval()
    pair.requires_grad_(False)
    T = ep.TensorSpec
    args = lambda t: (T("tokens", (1, t), "i64"), T("start", (1,), "i64"), T("pages", ("P",), "i8"))  # noqa: E731
    debug = []
    for kind, t in (("decode", 1), ("verify", block)):
        debug.append((ep.EntryPoint(f"{kind}_logits", "target", args(t),
                                    (T("logits", (1, t, V), "f32"), T("taps", (1, t, L * H), "bf16")), kind),
                      _logits_and_layers))
        debug.append((ep.EntryPoint(f"{kind}_chosen", "target", args(t), (T("chosen", (1, t), "i64"),), kind), _chosen))
    shapes = ep.ExportShapes(1, block, context, "bf16", L * H)
    out, _ = aot.export_module(pair, shapes, sampled=False, only=("prefill",), debug=debug)
    out.save_mlir(mlir)
    return L, H, V


def compare_rows(fn: dict, L: int, H: int, V: int, block: int, prompt, tokens, kv_page: int) -> dict:
    """Prefill PROMPT (int ids), verify TOKENS (BLOCK ids) after it, then decode them one by one at
    the same positions (decode j rewrites position len(PROMPT) + j's cache row with the same key and
    value verify wrote). FN maps each of DEBUG_FUNCTIONS to a callable taking numpy arrays and
    returning device arrays (`iree.runtime.FunctionInvoker`). Returns per row j the raw bits:
    "verify logits"/"decode logits" uint32 [B, V], "verify layers"/"decode layers" uint16 [B, L, H],
    "verify chosen"/"decode chosen" int64 [B]."""
    host = lambda xs: [np.asarray(x.to_host()) for x in (xs if isinstance(xs, (list, tuple)) else [xs])]  # noqa: E731
    prompt, tokens = np.asarray(prompt, np.int64), np.asarray(tokens, np.int64)
    n, B = len(prompt), block
    pages = lambda rows: np.zeros(-(-rows // kv_page), np.int8)  # noqa: E731 (as the runtime sizes them)
    fn["prefill"](prompt[None], np.array([0]), pages(n), np.zeros((1, 1), np.int64))
    lv, tv = host(fn["verify_logits"](tokens[None], np.array([n]), pages(n + B)))
    (cv,) = host(fn["verify_chosen"](tokens[None], np.array([n]), pages(n + B)))
    dec = [host(fn["decode_logits"](tokens[None, j:j + 1], np.array([n + j]), pages(n + j + 1))) for j in range(B)]
    chosen = [host(fn["decode_chosen"](tokens[None, j:j + 1], np.array([n + j]), pages(n + j + 1)))[0]
              for j in range(B)]
    return {"verify logits": lv[0].view(np.uint32),
            "decode logits": np.stack([d[0][0, 0] for d in dec]).view(np.uint32),
            "verify layers": tv.view(np.uint16).reshape(B, L, H),
            "decode layers": np.stack([d[1].view(np.uint16).reshape(L, H) for d in dec]),
            "verify chosen": cv[0], "decode chosen": np.array([c[0, 0] for c in chosen])}


def parts(rows: dict) -> dict[str, int]:
    """Differing elements per layer ("layer i"), of the logits and of the greedy tokens ("chosen"),
    over the block's rows, from `compare_rows`' result."""
    out = {f"layer {i}": int((rows["verify layers"][:, i] != rows["decode layers"][:, i]).sum())
           for i in range(rows["decode layers"].shape[1])}
    out["logits"] = int((rows["verify logits"] != rows["decode logits"]).sum())
    out["chosen"] = int((rows["verify chosen"] != rows["decode chosen"]).sum())
    return out
