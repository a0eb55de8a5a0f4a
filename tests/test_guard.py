"""dflash_iree/guard.py's free-memory probes (issue #22): a fake nvidia-smi on PATH and a fake sysfs
root stand in for the GPUs, so that these run on any host; and the out-of-memory line they feed.
"""

from __future__ import annotations

from dataclasses import fields
from pathlib import Path

import pytest

from dflash_iree import guard
from dflash_iree.manifest import DTYPES, Manifest

MiB = 2**20


@pytest.fixture
def fake_smi(tmp_path, monkeypatch):
    """Make `nvidia-smi` on PATH a script that prints `out` and exits with `rc`; returns a setter
    and the file where each call's arguments are recorded."""
    bin_dir, calls = tmp_path / "bin", tmp_path / "calls"
    bin_dir.mkdir()
    monkeypatch.setenv("PATH", str(bin_dir))
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)

    def make(out: str = "40960", rc: int = 0) -> Path:
        script = bin_dir / "nvidia-smi"
        script.write_text(f'#!/bin/sh\necho "$@" >> {calls}\nprintf "%s\\n" "{out}"\nexit {rc}\n')
        script.chmod(0o755)
        return calls
    return make


def test_cuda_free_from_nvidia_smi(fake_smi):
    calls = fake_smi("40960")
    assert guard._available_bytes("cuda") == 40960 * MiB
    assert guard._available_bytes("cuda://1") == 40960 * MiB
    lines = calls.read_text().splitlines()
    assert lines[0] == "--id=0 --query-gpu=memory.free --format=csv,noheader,nounits"
    assert lines[1].startswith("--id=1 ")


def test_cuda_index_counts_the_visible_devices(fake_smi, monkeypatch):
    calls = fake_smi("100")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,GPU-5e1f")
    assert guard._available_bytes("cuda://0") == 100 * MiB
    assert guard._available_bytes("cuda://1") == 100 * MiB
    assert guard._available_bytes("cuda://2") is None  # not visible: nvidia-smi is not asked
    assert [line.split()[0] for line in calls.read_text().splitlines()] == ["--id=3", "--id=GPU-5e1f"]


@pytest.mark.parametrize("out,rc", [("No devices were found", 6), ("40960", 1), ("[N/A]", 0), ("", 0)],
                         ids=["no-device", "failed", "not-a-number", "empty"])
def test_cuda_free_unknown_when_nvidia_smi_fails(fake_smi, out, rc):
    fake_smi(out, rc)
    assert guard._available_bytes("cuda") is None


def test_cuda_free_unknown_without_nvidia_smi(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))
    assert guard._available_bytes("cuda") is None
    assert guard._available_bytes("cuda://x") is None  # a device path that is no index


def _card(root: Path, name: str, total: int | None = None, used: int | None = None) -> None:
    dev = root / "class" / "drm" / name / "device"
    dev.mkdir(parents=True)
    if total is not None:
        (dev / "mem_info_vram_total").write_text(f"{total}\n")
    if used is not None:
        (dev / "mem_info_vram_used").write_text(f"{used}\n")


def test_hip_free_from_sysfs(tmp_path, monkeypatch):
    monkeypatch.delenv("HIP_VISIBLE_DEVICES", raising=False)
    _card(tmp_path, "card0")  # a display controller without VRAM counters: not a HIP device
    _card(tmp_path, "card0-DP-1")  # a connector, not a card
    _card(tmp_path, "card1", total=16 * 2**30, used=3 * 2**30)
    _card(tmp_path, "card10", total=8 * 2**30, used=2**30)
    assert guard._available_bytes("hip", sysfs=tmp_path) == 13 * 2**30
    assert guard._available_bytes("hip://1", sysfs=tmp_path) == 7 * 2**30  # card10 after card1, by number
    assert guard._available_bytes("hip://2", sysfs=tmp_path) is None
    monkeypatch.setenv("HIP_VISIBLE_DEVICES", "1")
    assert guard._available_bytes("hip://0", sysfs=tmp_path) == 7 * 2**30


def test_hip_free_unknown_without_the_files(tmp_path, monkeypatch):
    monkeypatch.delenv("HIP_VISIBLE_DEVICES", raising=False)
    assert guard._available_bytes("hip", sysfs=tmp_path / "absent") is None
    _card(tmp_path, "card0", total=2**30)  # no mem_info_vram_used
    assert guard._available_bytes("hip", sysfs=tmp_path) is None


def test_other_devices_unknown():
    assert guard._available_bytes("vulkan") is None
    assert guard._available_bytes("local-task") is not None  # /proc/meminfo, on Linux


def _manifest(**fields_) -> Manifest:
    """A Manifest with only the fields a test reads (the others None: nothing checks them here).
    By default 1 MiB of caches at max_context 1024 and 1 MiB of weights (f32 and bf16)."""
    return Manifest(**{**{f.name: None for f in fields(Manifest)}, "max_context": 1024, "kv_page": 32,
                       "state": {"globals": {"target.kv_cache": {"shape": [1, 1, 2, 1024, 128], "dtype": "f32"}}},
                       "parameters": {"target": {"w": {"shape": [2**17], "dtype": "f32"}},
                                      "drafter": {"e": {"shape": [2**18], "dtype": "bf16"}}}, **fields_})


def test_memory_needed_counts_every_dtype_by_its_size():
    state = {"globals": {f"g{n}": {"shape": [3, 2], "dtype": n} for n in DTYPES}}
    params = {"target": {"a": {"shape": [5], "dtype": "i64"}}, "drafter": {"b": {"shape": [], "dtype": "i1"}}}
    assert guard.memory_needed(_manifest(state=state, parameters=params)) == (
        6 * sum(d.bytes for d in DTYPES.values()), 5 * 8 + 1)
    assert guard.memory_needed(_manifest()) == (MiB, MiB)


def test_manifest_fields_read_first_are_manifest_fields():
    assert set(guard.MANIFEST_FIELDS) <= {f.name for f in fields(Manifest)}


def test_gpu_out_of_memory_names_free_and_a_context_that_fits(fake_smi):
    fake_smi("2")
    e = guard.out_of_memory(_manifest(), Path("compiled/sm_80"), "cuda://0", "RESOURCE_EXHAUSTED; while x")
    # 0.8 * 2 MiB - 1 MiB of weights leaves 0.6 MiB: 614 rows of 1 KiB, 608 in whole pages
    assert str(e) == ("out of device memory with compiled/sm_80: the KV caches need 1.0 MiB at max_context 1024 and "
                      "the weights 1.0 MiB, 2.0 MiB are free; recompile with --max-context 608 or less "
                      "(IREE: RESOURCE_EXHAUSTED)")
    # whole pages of the manifest's own kv_page
    e = guard.out_of_memory(_manifest(kv_page=64), Path("compiled/sm_80"), "cuda://0", "RESOURCE_EXHAUSTED")
    assert "recompile with --max-context 576 or less" in str(e)
    # a sliding drafter's ring (21 rows, whatever max_context) is taken off the room, not scaled
    ring = {"shape": [1, 1, 2, 21, 2048], "dtype": "f32"}  # 0.328 MiB
    state = {"globals": {"target.kv_cache": _manifest().state["globals"]["target.kv_cache"], "drafter.ctx_cache": ring}}
    e = guard.out_of_memory(_manifest(state=state), Path("compiled/sm_80"), "cuda://0", "RESOURCE_EXHAUSTED")
    assert "recompile with --max-context 256 or less" in str(e)  # (0.6 - 0.328) MiB = 278 rows of 1 KiB
