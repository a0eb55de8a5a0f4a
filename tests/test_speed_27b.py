"""bench/speed_27b.py's arithmetic, without a GPU: the bytes a step of the Qwen3.5-27B target moves
(its fixture config, the module built on the meta device) and the kernel kinds of a profile."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))


def test_step_bytes_count_weights_state_slots_and_kv_rows():
    import torch

    import speed_27b
    from dflash_iree.config import load_target_config
    from dflash_iree.export.qwen35 import Qwen35

    with pytest.warns(Warning):  # the fixture's vision tower and MTP head are not loaded
        cfg = load_target_config(ROOT / "tests/fixtures/qwen3.5-27b")
    with torch.device("meta"):
        target = Qwen35(cfg, 4096, (), 1, torch.bfloat16, state_slots=16)
    b = speed_27b._step_bytes(target, rows=608, block=16)
    slot = 48 * (48 * 128 * 128 * 4 + 3 * 10240 * 2)  # 48 GDN layers: f32 state and bf16 conv window
    assert b["state_slot"] == slot and b["state_tag"] == "48x128x128"
    assert b["kv_read"] == 16 * 2 * 608 * 4 * 256 * 2  # 16 attention layers, K and V, 4 KV heads of 256
    assert b["decode"] == b["weights"] + 2 * slot + b["kv_read"]
    assert b["verify"] == b["weights"] + 17 * slot + b["kv_read"]
    assert 51e9 < b["weights"] < 52e9  # every weight but the embedding table


def test_profile_kinds():
    import speed_27b

    prof = {"top": [{"kernel": "dflash_swiglu_mt1", "per_call": 64, "ms": 8.0},
                    {"kernel": "verify_async_dispatch_34_matvec_like_48x128x128_f32", "per_call": 48, "ms": 0.9},
                    {"kernel": "verify_async_dispatch_42_elementwise_48x16384_f32", "per_call": 48, "ms": 0.2},
                    {"kernel": "verify_async_dispatch_7_elementwise_16x48x128x128_f32", "per_call": 1, "ms": 0.1},
                    {"kernel": "dflash_gdn", "per_call": 48, "ms": 0.5},
                    {"kernel": "Memcpy DtoD (Device -> Device)", "per_call": 10, "ms": 0.3}]}
    kinds = speed_27b._split(prof, "48x128x128")["kinds"]
    assert kinds["linears (GEMM)"]["ms"] == 8.0
    # IREE's recurrence: a matvec by its name, the state's by its shape
    assert kinds["DeltaNet state ops (IREE)"] == {"ms": 1.0, "per_call": 49.0}
    assert kinds["other IREE dispatches"]["ms"] == 0.2
    assert kinds["GDN step"] == {"ms": 0.5, "per_call": 48.0} and kinds["copies"]["ms"] == 0.3
