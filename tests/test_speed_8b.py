"""The 8B speed benchmark's report (runtime/speed_report.py, which bench/speed_8b.py writes its
results with): ratios and goals derived from committed H200 results (no GPU needed)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dflash_iree.runtime import speed_report as sr

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("result", ["2026-11-30-o3/speed_8b_h200.json",  # before decode_ahead
                                    "2026-12-01-decode-dispatches/speed_8b_h200_pairs_peers.json"])
def test_committed_h200_results_derive_the_reported_ratios(result):
    r = json.loads((ROOT / "experiments" / result).read_text())
    stored = r["derived"]
    sr.derive(r)
    assert r["derived"] == stored and r["verify_decode_ratio"] == stored["verify_decode_ratio"]
    b16 = r["iree"]["b16"]
    ratio = b16["verify"]["median_ms"] / b16["decode"]["median_ms"]
    assert abs(ratio - r["verify_decode_ratio"]) < 1e-3
    table = sr.format_table(r)
    for goal in ("plain decode bandwidth", "verify(16) / decode", "draft / verify", "torch reduce-overhead"):
        assert goal in table


def test_host_timeline_rows_from_a_trace():
    """`timeline_rows` on a made-up trace of one step: three launches joined to their kernels by
    correlation id; the third kernel waits for its launch, which ends after the second kernel ends."""
    events = [{"name": "dflash_step", "ph": "X", "ts": 0, "dur": 200}]
    for i, (launch, kernel) in enumerate([(10, 30), (20, 45), (100, 110)]):
        events.append({"name": "cuLaunchKernel", "cat": "cuda_driver", "ph": "X", "ts": launch, "dur": 5,
                       "args": {"correlation": i}})
        events.append({"name": f"k{i}", "cat": "kernel", "ph": "X", "ts": kernel, "dur": 10, "args": {"correlation": i}})
    steps, _, rows = sr.timeline_rows(events)
    (row,) = rows
    assert len(steps) == 1 and row["launches"] == 3 and row["first_launch_us"] == 10
    assert row["last_launch_end_us"] == 105 and row["in_launches_us"] == 15 and row["between_launches_us"] == 80
    assert (row["gpu_start_us"], row["gpu_end_us"], row["gpu_busy_us"]) == (30, 120, 30)
    # 40 -> 45 the GPU waits on nothing the host does (the launch ended at 25); 55 -> 110 it waits
    # for a launch that ended at 105, a gap over 50 us
    assert row["gpu_waiting_for_launch_us"] == 55 and row["gpu_gaps_over_50us"] == 1
    assert row["driver_calls"] == {"cuLaunchKernel": [3, 15]}
