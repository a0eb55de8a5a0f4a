"""The stream dimension S: refused above 1 for users (the runtime serves stream 0 only), but kept
exporting and compiling, so that it still works when the runtime learns to serve several streams."""

from __future__ import annotations

import pytest

from dflash_iree.errors import DFlashError
from dflash_iree.export import compile as cc

CONTEXT = 256


def test_streams_above_one_refused(target_dir, drafter_dir):
    with pytest.raises(DFlashError, match=r"^--streams 2 is not supported yet: the runtime serves one stream"):
        cc.plan(target_dir, drafter_dir, max_context=CONTEXT, streams=2)


def test_two_streams_export_and_compile(target_dir, drafter_dir, tmp_path):
    """S = 2 through the internal `multi_stream` switch: the tiny pair exports (no export cache) and
    compiles for the host, with every entry point's stream dimension 2 and the top-K spliced.
    (For sm_80 the S = 2 module does not compile today: iree-compile fails translating one of its own
    dispatches, an i64 [1, 1] memref against a rank-reduced one, also with only the top-K and
    norm + rope splices run.)"""
    p = cc.plan(target_dir, drafter_dir, max_context=CONTEXT, streams=2, multi_stream=True,
                attention=cc.ARCHS["host"].attention)
    mlir = cc.export_cached(p, tmp_path, log=lambda m: None, use_cache=False)
    m = cc.lower(p, "host", mlir, tmp_path / "host", log=lambda m: None)
    assert (tmp_path / "host" / cc.MODULE_FILE).is_file() and m.streams == 2 and m.shapes["streams"] == 2
    e = {x["name"]: x for x in m.entry_points}
    assert e["verify"]["args"][0] == {"name": "tokens", "shape": [2, 8], "dtype": "i64"}
    assert e["draft"]["args"][-1] == {"name": "draft", "shape": [2, 7], "dtype": "i64"}
    assert m.state["globals"]["target.kv_cache"]["shape"][0] == 2
    assert m.splices["topk"]
