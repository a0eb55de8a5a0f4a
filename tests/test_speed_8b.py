"""bench/speed_8b.py's report: ratios and goals derived from the committed H200 results (no GPU needed)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _module():
    spec = importlib.util.spec_from_file_location("speed_8b", ROOT / "bench" / "speed_8b.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_committed_h200_results_derive_the_reported_ratios():
    sb = _module()
    r = json.loads((ROOT / "bench" / "results" / "speed_8b_h200.json").read_text())
    stored = r["derived"]
    sb._derive(r)
    assert r["derived"] == stored and r["verify_decode_ratio"] == stored["verify_decode_ratio"]
    b16 = r["iree"]["b16"]
    ratio = b16["verify"]["median_ms"] / b16["decode"]["median_ms"]
    assert abs(ratio - r["verify_decode_ratio"]) < 1e-3
    table = sb.format_table(r)
    for goal in ("plain decode bandwidth", "verify(16) / decode", "draft / verify", "torch reduce-overhead"):
        assert goal in table
