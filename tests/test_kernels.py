"""Draft top-K custom dispatch: host parity through the CLI, refusals, the poison control, the committed objects."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest

from dflash_iree.errors import DFlashError
from dflash_iree.kernels import build, isa
from dflash_iree.kernels.topk.reference import make_logits, reference, score
from dflash_iree.kernels.topk import ARCHS, OBJECTS_DIR, device_flags, standalone_module, topk_dispatch

ic = pytest.importorskip("iree.compiler")
rt = pytest.importorskip("iree.runtime")


def _load(src: str, flags: list[str]):
    vmfb = ic.compile_str(src, extra_args=device_flags("host") + flags)
    config = rt.Config("local-task")
    ctx = rt.SystemContext(config=config)
    ctx.add_vm_module(rt.VmModule.copy_buffer(config.vm_instance, vmfb))
    return ctx.modules.topk_check


def test_topk_check_host_all_cases_pass(tmp_path):
    out = tmp_path / "rows.json"
    r = subprocess.run([sys.executable, "-m", "dflash_iree", "topk-check", "--json", str(out)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    rows = json.loads(out.read_text())["rows"]
    assert len(rows) == 10 and all(row["pass"] for row in rows)
    assert all(row["id_mismatch"] == 0 and row["max_lp_err"] <= 2e-3 for row in rows[1:])
    assert "65" in rows[0]["case"] and "outside" in rows[0]["refused"]


@pytest.mark.parametrize("K", [0, 65, 1000])
def test_k_outside_the_kernel_is_refused(K):
    with pytest.raises(DFlashError, match=r"outside the top-K kernel.*1 <= K <= 64"):
        topk_dispatch(15, 151936, K, "host")


def test_other_refusals():
    with pytest.raises(DFlashError, match="at least K"):
        topk_dispatch(1, 4, 8, "host")
    with pytest.raises(DFlashError, match="unknown arch"):
        topk_dispatch(1, 1024, 8, "sm_90")


def test_unwritten_outputs_show_as_poison():
    """Control: with the merge dispatch removed, the poisoned storage comes back and fails the score."""
    d = topk_dispatch(3, 257, 8, "host")
    src = re.sub(r"    %r:2 = flow\.dispatch @dflash_topk_merge.*\n    util\.return %r#0, %r#1",
                 "    util.return %ids0, %lp0", standalone_module(d))
    assert "@dflash_topk_merge::" not in src
    fn = _load(src, d.flags).topk_into
    x = make_logits(3, 257, 8, np.random.default_rng(0))
    ids, lps = fn(x, 1.0, np.full((3, 8), -7, np.int32), np.full((3, 8), np.nan, np.float32))
    s = score(x, 1.0, np.asarray(ids), np.asarray(lps))
    assert s["id_mismatch"] == 24 and s["max_lp_err"] == float("inf") and not s["pass"]


def test_score_tells_tie_swaps_from_mismatches():
    x = np.array([[3.0, 5.0, 5.0, 1.0, 2.0]], np.float32)
    ids, lsm = reference(x, 3, 1.0)
    assert ids.tolist() == [[1, 2, 0]]
    lp = lsm[0, [1, 2, 0]][None].astype(np.float32)
    assert score(x, 1.0, np.array([[1, 2, 0]]), lp)["pass"]
    swapped = score(x, 1.0, np.array([[2, 1, 0]]), lp)
    assert (swapped["tie_swap"], swapped["id_mismatch"], swapped["pass"]) == (2, 0, True)
    wrong = score(x, 1.0, np.array([[1, 2, 4]]), lp)
    assert wrong["id_mismatch"] == 1 and not wrong["pass"]
    repeated = score(x, 1.0, np.array([[1, 1, 0]]), lp)
    assert repeated["id_mismatch"] == 1 and not repeated["pass"]


def test_bf16_logits_are_widened():
    import ml_dtypes

    d = topk_dispatch(2, 3000, 5, "host", dtype="bf16")
    x = make_logits(2, 3000, 5, np.random.default_rng(1)).astype(ml_dtypes.bfloat16)
    ids, lps = _load(standalone_module(d), d.flags).topk(x, 0.8)
    s = score(x.astype(np.float32), 0.8, np.asarray(ids), np.asarray(lps))
    assert s["pass"] and s["id_mismatch"] == 0


def test_committed_objects_are_sound_and_current():
    """Every object holds its kernels (gfx: ISA, no scratch, no spills) and was built from today's sources."""
    manifest = json.loads((OBJECTS_DIR / "manifest.json").read_text())
    assert manifest["ptx_isa"] == build.PTX_ISA and build.PINNED in manifest["compiler"]
    for s in build.SOURCES:
        assert manifest["sources"][s] == build.sha256(build.HERE / s), f"{s} changed since `make kernels`"
    assert set(manifest["objects"]) == set(build.targets())
    for name, info in manifest["objects"].items():
        path = OBJECTS_DIR / name
        assert build.sha256(path) == info["sha256"], name
        assert isa.inspect_object(path, info["arch"].replace("host-arm_64", "host"), isa.kernels_of(name)) == [], name


# IREE 3.13 has no gfx1030 among its known ROCm targets ("Unknown ROCM target 'gfx1030'"): its code
# object builds and passes inspection, but no module can take it until IREE knows the chip.
_NO_IREE_TARGET = pytest.mark.xfail(strict=True, reason="IREE 3.13: Unknown ROCM target 'gfx1030'")


@pytest.mark.parametrize("arch", [pytest.param(a, marks=_NO_IREE_TARGET) if a == "gfx1030" else a
                                  for a in ARCHS if a != "host"])
def test_gpu_modules_compile(arch):
    d = topk_dispatch(15, 151936, 8, arch)
    vmfb = ic.compile_str(standalone_module(d), extra_args=device_flags(arch) + d.flags)
    assert b"dflash_topk_partial" in vmfb and b"dflash_topk_merge" in vmfb


def test_objects_rebuild_identically():
    version = build.clang_version()
    if version is None:
        pytest.skip("clang-19 and lld-19 are not installed (apt-get install clang-19 lld-19): rebuild not compared")
    if build.PINNED not in version:
        pytest.skip(f"objects are pinned to clang-19 {build.PINNED}, this machine has '{version}'")
    assert shutil.which("ld.lld-19")
    assert build.main(["--check"]) == 0
