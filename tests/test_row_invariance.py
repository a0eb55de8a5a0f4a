"""Row invariance on the host (issue #24): the decode graph (1 row) and the verify graph (B rows)
give one position the same bf16 logits, bit for bit, so drafted decoding equals plain decoding.

The demo target (bf16, committed) is exported with two debug functions that return what the
production entry points keep on the device: the float32 logits and every layer's output, of a
decode (tokens [1, 1]) and of a verify (tokens [1, 8]) at the same position after the same prefill.
Compiled with the host's flags (dflash_iree/arch.py `HOST_ROW_INVARIANT`), row 0 of the verify
equals the decode. The planted control is the same module compiled without that flag: it must part
(it did in 7102 of 8192 logits, experiments/2026-12-03-host-row-ops/).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "models" / "demo"
B, CONTEXT, PROMPT = 8, 256, 40


def _logits_and_layers(m, tokens, start, pages):
    """The body of both debug functions: the target's step, returning its float32 logits and taps."""
    from dflash_iree.export.entry_points import _read_len

    _, logits, taps = m.target(tokens, start, None, read_len=_read_len(pages))
    return logits, taps


@pytest.fixture(scope="module")
def debug_mlir(tmp_path_factory) -> tuple[Path, int, int, int]:
    """The demo target (every layer tapped) with `prefill`, `decode_logits` and `verify_logits`,
    exported and spliced for the host. Returns (spliced module, layers, hidden, vocab)."""
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
    debug = [(ep.EntryPoint(name, "target", (T("tokens", (1, t), "i64"), T("start", (1,), "i64"),
                                             T("pages", ("P",), "i8")),
                            (T("logits", (1, t, V), "f32"), T("taps", (1, t, L * H), "bf16")), name), _logits_and_layers)
             for name, t in (("decode_logits", 1), ("verify_logits", B))]
    shapes = ep.ExportShapes(1, B, CONTEXT, "bf16", L * H)
    work = tmp_path_factory.mktemp("row-invariance")
    out, _ = aot.export_module(pair, shapes, sampled=False, only=("prefill",), debug=debug)
    out.save_mlir(work / "m.mlir")
    src, _, _ = splice_file(work / "m.mlir", work / "spliced.mlirbc", "host")
    return src, L, H, V


def _rows(mlir: Path, flags: list[str], L: int, H: int, V: int) -> dict[str, np.ndarray]:
    """Compile with `flags`, prefill a prompt, then decode and verify at the same position: the
    decode's row and the verify's row 0 of the logits and of every layer, as raw bits."""
    import iree.runtime as rt

    from dflash_iree.checkpoint import index_checkpoint
    from dflash_iree.export.entry_points import KV_PAGE
    from dflash_iree.export.iree_tool import run_iree_compile

    vmfb = mlir.with_name(f"m{abs(hash(tuple(flags)))}.vmfb")
    run_iree_compile(mlir, vmfb, flags, vmfb.with_suffix(".csv"))
    inst, dev = rt.VmInstance(), rt.get_device("local-task")
    index = rt.ParameterIndex()
    for f in sorted({i.file for i in index_checkpoint(DEMO / "target").values()}):
        index.load(str(f))
    vm = rt.VmModule.mmap(inst, str(vmfb))
    ctx = rt.VmContext(inst, modules=[rt.create_hal_module(inst, dev),
                                      rt.create_io_parameters_module(inst, index.create_provider(scope="target")), vm])
    fn = {n: rt.FunctionInvoker(ctx, dev, vm.lookup_function(n)) for n in ("prefill", "decode_logits", "verify_logits")}
    rng = np.random.default_rng(0)
    prompt = rng.integers(10, V, PROMPT)
    pages = np.zeros(-(-(PROMPT + B) // KV_PAGE), np.int8)
    fn["prefill"](prompt[None], np.array([0]), pages, np.zeros((1, 1), np.int64))
    block, start = rng.integers(10, V, B), np.array([PROMPT])
    # the verify first: the decode then rewrites position PROMPT's cache row with the same key and value
    lv, tv = (np.asarray(x.to_host()) for x in fn["verify_logits"](block[None], start, pages))
    ld, td = (np.asarray(x.to_host()) for x in fn["decode_logits"](block[None, :1], start, pages))
    return {"verify logits": lv[0, 0].view(np.uint32), "decode logits": ld[0, 0].view(np.uint32),
            "verify layers": tv.view(np.uint16).reshape(B, L, H)[0], "decode layers": td.view(np.uint16).reshape(L, H)}


def _parts(rows: dict) -> dict[str, int]:
    out = {f"layer {i}": int((rows["verify layers"][i] != rows["decode layers"][i]).sum())
           for i in range(rows["decode layers"].shape[0])}
    out["logits"] = int((rows["verify logits"] != rows["decode logits"]).sum())
    return out


def test_decode_row_equals_verify_row_on_the_host(debug_mlir):
    from dflash_iree.arch import ARCHS

    src, L, H, V = debug_mlir
    parts = _parts(_rows(src, list(ARCHS["host"].flags), L, H, V))
    assert all(n == 0 for n in parts.values()), f"decode and verify part (differing elements): {parts}"


def test_planted_without_the_row_invariant_flag_parts(debug_mlir):
    """The planted control: the host's flags less `HOST_ROW_INVARIANT` round the rows differently."""
    from dflash_iree.arch import ARCHS, HOST_ROW_INVARIANT

    src, L, H, V = debug_mlir
    flags = [f for f in ARCHS["host"].flags if f not in HOST_ROW_INVARIANT]
    assert len(flags) == len(ARCHS["host"].flags) - len(HOST_ROW_INVARIANT)
    parts = _parts(_rows(src, flags, L, H, V))
    assert parts["logits"] > 0 and parts["layer 0"] > 0, parts
