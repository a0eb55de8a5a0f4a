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

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "models" / "demo"
B, CONTEXT, PROMPT = 8, 256, 40
# bench prompt 5 and its first 16 greedy tokens, then the next block: at its row 0 the top two logits
# (ids 1338, 429) are 10.620 and 10.596, both 10.625 in bf16; the argmax of the bf16 values is 429.
TIE_PREFIX = [535, 1100, 64, 1741, 9, 1142, 13, 1160, 13, 892, 290, 279, 433, 1093, 1333, 467, 6631, 2779, 445, 1452,
              15, 326, 4452, 1811, 725, 6557, 408, 5908, 1596, 15, 279, 433, 279, 362, 451, 1147, 9, 1142, 13, 429,
              5725, 15, 53, 864, 64, 2315, 290, 263]
TIE_BLOCK = [391, 429, 5725, 15, 53, 864, 64, 2315]


def export_debug(work: Path) -> tuple[Path, int, int, int]:
    """The demo target (every layer tapped) with `prefill` and the debug functions (export/row_check.py),
    exported and spliced for the host into folder `work`. Returns (spliced module, layers, hidden, vocab)."""
    from dflash_iree.export.row_check import export_row_module
    from dflash_iree.export.splice import splice_file

    L, H, V = export_row_module(DEMO / "target", DEMO / "drafter", work / "m.mlir", B, CONTEXT, "matmul")
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
    from dflash_iree.export.row_check import DEBUG_FUNCTIONS, compare_rows

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
    fn = {n: rt.FunctionInvoker(ctx, dev, vm.lookup_function(n)) for n in DEBUG_FUNCTIONS}
    rng = np.random.default_rng(0)
    prompt = rng.integers(10, V, PROMPT) if prompt is None else prompt
    block = rng.integers(10, V, B) if block is None else block
    return compare_rows(fn, L, H, V, B, prompt, block, KV_PAGE)


def _parts(rows: dict) -> dict[str, int]:
    from dflash_iree.export.row_check import parts

    return parts(rows)


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
