"""Row invariance on the host (issue #24): the decode graph (1 row) and the verify graph (B rows)
give one position the same bf16 logits, bit for bit, and the same greedy token, so drafted
decoding equals plain decoding.

The demo target (bf16, committed) is exported with debug functions that return what the production
entry points keep on the device: the float32 logits and every layer's output (`*_logits`), and
the greedy token alone (`*_chosen`, the production graph's tail: the argmax reads the logits in the
same dispatch), of a decode (tokens [1, 1]) and of a verify (tokens [1, 8]) after the same prefill.
Decode j (at start + j) is compared with verify row j.

Planted controls: the module compiled without the host's row-invariant flag (dflash_iree/arch.py
`HOST_ROW_INVARIANT`) parts on the logits; the module exported with plain `.float()` logits in place
of export/qwen3.py `as_float32` parts on the greedy token at a bf16 tie of the top two logits (found
on bench prompt 5 of code.jsonl; experiments/2026-12-03-host-row-ops/).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "models" / "demo"
B, CONTEXT, PROMPT = 8, 256, 40
# bench prompt 5 and its first 16 greedy tokens, then the next block: at its row 0 the top two logits
# (ids 1338, 429) are 10.620 and 10.596, both 10.625 in bf16; the argmax of the bf16 values is 429.
TIE_PREFIX = [535, 1100, 64, 1741, 9, 1142, 13, 1160, 13, 892, 290, 279, 433, 1093, 1333, 467, 6631, 2779, 445, 1452,
              15, 326, 4452, 1811, 725, 6557, 408, 5908, 1596, 15, 279, 433, 279, 362, 451, 1147, 9, 1142, 13, 429,
              5725, 15, 53, 864, 64, 2315, 290, 263]
TIE_BLOCK = [391, 429, 5725, 15, 53, 864, 64, 2315]


def _logits_and_layers(m, tokens, start, pages):
    """The body of the `*_logits` functions: the target's step, returning its float32 logits and taps."""
    from dflash_iree.export.entry_points import _read_len

    _, logits, taps = m.target(tokens, start, None, read_len=_read_len(pages))
    return logits, taps


def _chosen(m, tokens, start, pages):
    """The body of the `*_chosen` functions: the target's greedy tokens only, as production computes them."""
    from dflash_iree.export.entry_points import _read_len

    return m.target(tokens, start, None, read_len=_read_len(pages))[0]


def export_debug(work: Path) -> tuple[Path, int, int, int]:
    """The demo target (every layer tapped) with `prefill` and the debug functions, exported and
    spliced for the host into folder `work`. Returns (spliced module, layers, hidden, vocab)."""
    from dflash_iree.config import load_drafter_config, load_target_config
    from dflash_iree.export import aot, entry_points as ep
    from dflash_iree.export.dflash import DFlashDrafter
    from dflash_iree.export.qwen3 import Qwen3
    from dflash_iree.export.splice import splice_file

    tcfg = load_target_config(DEMO / "target")
    dcfg = load_drafter_config(DEMO / "drafter", tcfg)
    L, H, V = tcfg.num_hidden_layers, tcfg.hidden_size, tcfg.vocab_size
    with torch.device("meta"):
        target = Qwen3(tcfg, CONTEXT, tuple(range(L)), 1, torch.bfloat16, attention="matmul")
        drafter = DFlashDrafter(dcfg, CONTEXT, B, 1, torch.bfloat16, attention="matmul")
    pair = aot.Pair(target, drafter).eval()
    pair.requires_grad_(False)
    T = ep.TensorSpec
    args = lambda t: (T("tokens", (1, t), "i64"), T("start", (1,), "i64"), T("pages", ("P",), "i8"))  # noqa: E731
    debug = []
    for kind, t in (("decode", 1), ("verify", B)):
        debug.append((ep.EntryPoint(f"{kind}_logits", "target", args(t),
                                    (T("logits", (1, t, V), "f32"), T("taps", (1, t, L * H), "bf16")), kind),
                      _logits_and_layers))
        debug.append((ep.EntryPoint(f"{kind}_chosen", "target", args(t), (T("chosen", (1, t), "i64"),), kind), _chosen))
    shapes = ep.ExportShapes(1, B, CONTEXT, "bf16", L * H)
    out, _ = aot.export_module(pair, shapes, sampled=False, only=("prefill",), debug=debug)
    out.save_mlir(work / "m.mlir")
    src, _, _ = splice_file(work / "m.mlir", work / "spliced.mlirbc", "host")
    return src, L, H, V


@pytest.fixture(scope="module")
def debug_mlir(tmp_path_factory) -> tuple[Path, int, int, int]:
    return export_debug(tmp_path_factory.mktemp("row-invariance"))


def _rows(mlir: Path, flags: list[str], L: int, H: int, V: int, prompt=None, block=None) -> dict[str, np.ndarray]:
    """Compile with `flags`, prefill `prompt` (default PROMPT random ids), verify `block` (default
    random) after it, then decode its tokens one by one at the same positions: per row j, verify's
    row j and decode j of the logits (raw bits), every layer (raw bits) and the greedy token."""
    import iree.runtime as rt

    from dflash_iree.checkpoint import index_checkpoint
    from dflash_iree.export.entry_points import KV_PAGE
    from dflash_iree.export.iree_tool import run_iree_compile

    vmfb = mlir.with_name(f"m{abs(hash(tuple(flags)))}.vmfb")
    if not vmfb.exists():
        run_iree_compile(mlir, vmfb, flags, vmfb.with_suffix(".csv"))
    inst, dev = rt.VmInstance(), rt.get_device("local-task")
    index = rt.ParameterIndex()
    for f in sorted({i.file for i in index_checkpoint(DEMO / "target").values()}):
        index.load(str(f))
    vm = rt.VmModule.mmap(inst, str(vmfb))
    ctx = rt.VmContext(inst, modules=[rt.create_hal_module(inst, dev),
                                      rt.create_io_parameters_module(inst, index.create_provider(scope="target")), vm])
    names = ("prefill", "decode_logits", "verify_logits", "decode_chosen", "verify_chosen")
    fn = {n: rt.FunctionInvoker(ctx, dev, vm.lookup_function(n)) for n in names}
    host = lambda xs: [np.asarray(x.to_host()) for x in (xs if isinstance(xs, (list, tuple)) else [xs])]  # noqa: E731
    rng = np.random.default_rng(0)
    prompt = rng.integers(10, V, PROMPT) if prompt is None else np.array(prompt)
    block = rng.integers(10, V, B) if block is None else np.array(block)
    n = len(prompt)
    pages = lambda rows: np.zeros(-(-rows // KV_PAGE), np.int8)  # noqa: E731 (as the runtime sizes them)
    fn["prefill"](prompt[None], np.array([0]), pages(n), np.zeros((1, 1), np.int64))
    # the verify first; decode j then rewrites position n + j's cache row with the same key and value
    lv, tv = host(fn["verify_logits"](block[None], np.array([n]), pages(n + B)))
    (cv,) = host(fn["verify_chosen"](block[None], np.array([n]), pages(n + B)))
    dec = [host(fn["decode_logits"](block[None, j:j + 1], np.array([n + j]), pages(n + j + 1))) for j in range(B)]
    chosen = [host(fn["decode_chosen"](block[None, j:j + 1], np.array([n + j]), pages(n + j + 1)))[0] for j in range(B)]
    return {"verify logits": lv[0].view(np.uint32),
            "decode logits": np.stack([d[0][0, 0] for d in dec]).view(np.uint32),
            "verify layers": tv.view(np.uint16).reshape(B, L, H),
            "decode layers": np.stack([d[1].view(np.uint16).reshape(L, H) for d in dec]),
            "verify chosen": cv[0], "decode chosen": np.array([c[0, 0] for c in chosen])}


def _parts(rows: dict) -> dict[str, int]:
    """Differing elements per layer, of the logits and of the greedy tokens, over the block's rows."""
    out = {f"layer {i}": int((rows["verify layers"][:, i] != rows["decode layers"][:, i]).sum())
           for i in range(rows["decode layers"].shape[1])}
    out["logits"] = int((rows["verify logits"] != rows["decode logits"]).sum())
    out["chosen"] = int((rows["verify chosen"] != rows["decode chosen"]).sum())
    return out


def _host_flags() -> list[str]:
    from dflash_iree.arch import ARCHS

    return list(ARCHS["host"].flags)


@pytest.mark.parametrize("case", ["random", "random, verify reads more pages", "bf16 tie"])
def test_decode_row_equals_verify_row_on_the_host(debug_mlir, case):
    src, L, H, V = debug_mlir
    kw = {"random": {}, "random, verify reads more pages": {"prompt": np.arange(60) + 10},  # 96 rows against 64
          "bf16 tie": {"prompt": TIE_PREFIX, "block": TIE_BLOCK}}[case]
    rows = _rows(src, _host_flags(), L, H, V, **kw)
    parts = _parts(rows)
    assert all(n == 0 for n in parts.values()), f"decode and verify part (differing elements): {parts}"
    if case == "bf16 tie":
        assert rows["verify chosen"][0] == rows["decode chosen"][0] == 429  # bf16's argmax: the first of the tie


def test_planted_without_the_row_invariant_flag_parts(debug_mlir):
    """Planted: the host's flags less `HOST_ROW_INVARIANT` round the rows differently."""
    from dflash_iree.arch import HOST_ROW_INVARIANT

    src, L, H, V = debug_mlir
    flags = [f for f in _host_flags() if f not in HOST_ROW_INVARIANT]
    assert len(flags) == len(_host_flags()) - len(HOST_ROW_INVARIANT)
    parts = _parts(_rows(src, flags, L, H, V))
    assert parts["logits"] > 0 and parts["layer 0"] > 0, parts


def test_planted_float_logits_part_at_a_tie(tmp_path, monkeypatch):
    """Planted: logits cast by `.float()` (a truncation IREE may fuse away) instead of `as_float32`:
    at the bf16 tie decode takes the argmax of unrounded logits, verify of rounded ones."""
    from dflash_iree.export import qwen3

    monkeypatch.setattr(qwen3, "as_float32", lambda x: x.float())
    src, L, H, V = export_debug(tmp_path)
    parts = _parts(_rows(src, _host_flags(), L, H, V, prompt=TIE_PREFIX, block=TIE_BLOCK))
    assert parts["chosen"] > 0 and parts["logits"] == 0, parts
