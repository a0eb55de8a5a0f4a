"""The Gated DeltaNet step dispatch (kernels/gdn/): objects, MLIR, refusals, GPU compiles, and its
NumPy reference against the eager rule of export/gdn.py. The kernel's body also runs on the host,
its workgroups' threads as host threads (kernels/gdn/gdn_host.cc, kernels/simt_host.h), bit for bit
against the reference; on a GPU, its bits, row invariance and speed are bench/gdn_check.py."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

from dflash_iree.errors import DFlashError
from dflash_iree.kernels.gdn import ARCHS, gdn_dispatch, object_file, standalone_module
from dflash_iree.kernels.isa import GDN_KERNELS, amdgpu_kernels, inspect_object

SLOTS = (1, 16, 2, 48, 128, 128)


@pytest.mark.parametrize("arch", ARCHS)
def test_objects_are_sound(arch):
    """Every GPU arch's object holds the entry point: gfx with no scratch and no spills (and few
    enough VGPRs for 16 waves a SIMD), PTX 7.8 with no local memory and no contracted multiply-add."""
    obj = object_file(arch)
    assert inspect_object(obj, arch, GDN_KERNELS) == []
    if arch.startswith("gfx"):
        meta = amdgpu_kernels(obj)["dflash_gdn"]
        assert meta[".vgpr_count"] <= 64 and meta[".group_segment_fixed_size"] <= 20 * 1024
    else:
        assert "fma.rn.f32" not in obj.read_text()


@pytest.mark.parametrize("args,match", [((1, 4, 16, 48, 128, 128, SLOTS, "bf16", "host"), "no Gated DeltaNet"),
                                        ((1, 17, 16, 48, 128, 128, SLOTS, "bf16", "sm_80"), "T=17"),
                                        ((1, 4, 16, 48, 130, 128, (1, 16, 2, 48, 130, 128), "bf16", "sm_80"), "dk=130"),
                                        ((1, 4, 16, 40, 128, 128, SLOTS, "bf16", "sm_80"), "not a multiple"),
                                        ((1, 4, 16, 48, 128, 128, (1, 2, 2, 48, 128, 128), "bf16", "sm_80"), "more than"),
                                        ((1, 4, 16, 48, 128, 128, SLOTS, "f16", "gfx1151"), "dtype f16")])
def test_refusals(args, match):
    with pytest.raises(DFlashError, match=match):
        gdn_dispatch(*args)


def test_mlir():
    d = gdn_dispatch(1, 8, 16, 48, 128, 128, SLOTS, "bf16", "sm_80", name="g")
    assert d.grid == (16, 48, 1) and d.conv_dim == 10240
    # the slots are a tied operand: written in place, returned as the function's second result
    assert "@g_exe::@dflash_gdn[%gx, %gy, %gz]" in d.mlir
    assert "-> (%slots, tensor<1x8x48x128xbf16>)" in d.mlir
    assert "util.return %r#1, %r#0 : tensor<1x8x48x128xbf16>, tensor<1x16x2x48x128x128xf32>" in d.mlir
    assert "%cscale = arith.constant 1035273459 : i32" in d.mlir  # 128 ** -0.5 as f32 bits
    assert "%cevery = arith.constant 1 : i32" in d.mlir
    # the last state only (a prefill's blocks): more rows than slots are fine, one slot row is written
    last = gdn_dispatch(1, 16, 16, 48, 128, 128, (1, 2, 2, 48, 128, 128), "bf16", "sm_80", every_row=False)
    assert "%cevery = arith.constant 0 : i32" in last.mlir


@pytest.mark.parametrize("arch", ["sm_80", "gfx1151"])
def test_compiles_for_gpu_targets(arch):
    ic = pytest.importorskip("iree.compiler")
    from dflash_iree.export.compile import compile_flags, resolve_arch

    flags = [f for f in compile_flags(resolve_arch(arch)[0]) if "opt-level" not in f]
    for args in [(1, 16, 16, 48, 128, 128, SLOTS, "bf16"), (2, 3, 2, 4, 8, 8, (2, 4, 3, 4, 8, 8), "f32")]:
        d = gdn_dispatch(*args, arch)
        assert len(ic.compile_str(standalone_module(d), extra_args=flags + d.flags)) > 5000


def _case(S, T, Hk, Hv, dk, dv, dtype, seed=0, fresh=False, B=4, n=3, layer=1):
    """Seeded inputs, the eager rule's o and states (export/gdn.py), and kernels/gdn/reference.py's result."""
    import torch
    import torch.nn.functional as F

    from dflash_iree.export.gdn import prepare, recurrent_rule
    from dflash_iree.kernels.gdn.reference import gdn_step

    g = torch.Generator().manual_seed(seed)
    dt = {"f32": torch.float32, "bf16": torch.bfloat16}[dtype]
    mixed = F.silu(torch.randn(S, T, 2 * Hk * dk + Hv * dv, generator=g)).to(dt)
    b = torch.randn(S, T, Hv, generator=g).to(dt)
    a = (torch.randn(S, T, Hv, generator=g) * 2).to(dt)
    A_log = (torch.rand(Hv, generator=g) * 2 - 1).to(dt)
    dt_bias = torch.randn(Hv, generator=g).to(dt)
    slots = torch.randn(S, B, n, Hv, dk, dv, generator=g) * 0.1
    rows = np.array([[-1 if fresh else s * B + 2, s * B] for s in range(S)], np.int32)
    q, k, v = torch.split(mixed, [Hk * dk, Hk * dk, Hv * dv], -1)
    beta = b.sigmoid()
    gate = -A_log.float().exp() * F.softplus(a.float() + dt_bias)
    flat = slots.view(S * B, n, Hv, dk, dv)
    state = torch.zeros(S, Hv, dk, dv) if fresh else torch.stack([flat[rows[s, 0], layer] for s in range(S)])
    o, states = recurrent_rule(*prepare(q.reshape(S, T, Hk, dk), k.reshape(S, T, Hk, dk), v.reshape(S, T, Hv, dv),
                                        beta, gate), state)
    f = lambda t: t.float().numpy()  # noqa: E731
    ro, rs = gdn_step(f(mixed), f(b), f(a), f(A_log), f(dt_bias), slots.numpy(), rows, layer, Hk, dk, dtype)
    return f(o.transpose(1, 2).to(dt)), torch.stack(states, 1).numpy(), ro, rs, slots.numpy(), rows


def _slots_hold(states, slots_after, slots_before, rows, layer=1):
    """Whether slots_after holds states[s, t] at flat row rows[s, 1] + t of `layer` (to float32
    rounding) and slots_before everywhere else."""
    S, T = states.shape[:2]
    flat_a = slots_after.reshape(-1, *slots_after.shape[2:])
    flat_b = slots_before.reshape(-1, *slots_before.shape[2:])
    keep = np.ones(flat_a.shape[:2], bool)
    for s in range(S):
        for t in range(T):
            keep[rows[s, 1] + t, layer] = False
            if not np.allclose(flat_a[rows[s, 1] + t, layer], states[s, t], rtol=0, atol=1e-5):
                return False
    return bool(np.array_equal(flat_a[keep], flat_b[keep]))


@pytest.mark.parametrize("shape", [(1, 1, 2, 4, 8, 8, "f32"), (2, 4, 2, 4, 8, 8, "f32"),
                                   (1, 4, 2, 6, 128, 128, "bf16"), (1, 3, 1, 3, 128, 128, "f32", 1, True)])
def test_numpy_reference_matches_the_eager_rule(shape):
    """reference.py (the kernel's order and polynomials) against export/gdn.py's eager rule: o and
    every written state within float32 rounding (bf16 o: at most one bf16 ulp), the other slots untouched."""
    o, states, ro, rs, slots, rows = _case(*shape)
    scale = max(1.0, float(np.abs(o).max()))
    assert np.abs(ro - o).max() <= (2 ** -7 if shape[6] == "bf16" else 1e-6) * scale
    assert _slots_hold(states, rs, slots, rows)


def test_a_wrong_slot_is_caught():
    """Planted control: the same states written one slot further on (base + 1) fail the slot check."""
    o, states, ro, rs, slots, rows = _case(2, 2, 2, 4, 8, 8, "f32")
    assert _slots_hold(states, rs, slots, rows)
    shifted = rows.copy()
    shifted[:, 1] += 1
    assert not _slots_hold(states, rs, slots, shifted)


GDN_DIR = Path(__file__).resolve().parents[1] / "kernels" / "gdn"


def _build_host_body(out: Path, *defines: str) -> Path:
    """kernels/gdn/gdn_host.cc built with the host's C++20 compiler (skips the test without one)."""
    cxx = next((c for c in ("c++", "g++", "clang++", "clang++-19") if shutil.which(c)), None)
    if cxx is None:
        pytest.skip("no C++ compiler to build the host body (kernels/gdn/gdn_host.cc)")
    exe = out / "gdn_host"
    r = subprocess.run([cxx, "-std=c++20", "-O1", "-ffp-contract=off", "-fno-strict-aliasing", "-pthread", *defines, "gdn_host.cc", "-o",
                        str(exe)], cwd=GDN_DIR, capture_output=True, text=True)
    if r.returncode and ("c++20" in r.stderr.lower() or "barrier" in r.stderr):
        pytest.skip(f"{cxx} has no C++20 (std::barrier): {r.stderr.splitlines()[0]}")
    assert r.returncode == 0, r.stderr
    return exe


def _run_host_body(exe: Path, work: Path, S, T, Hk, Hv, dk, dv, dtype, seed=0, n=2, layer=1, fresh_stream=None,
                   every_row=True, ref_every_row=None, read_at=3):
    """The host body's (o, slots) and reference.py's on seeded inputs, B = max(T, 8) slots a stream:
    stream s reads flat row s * B + read_at (or zeros for `fresh_stream`) and writes from s * B, every
    row's state or the last only (every_row; the reference's as ref_every_row, default the same)."""
    import ml_dtypes

    from dflash_iree.kernels.gdn.reference import gdn_step
    from dflash_iree.kernels.hal import f32_bits

    B = max(T, 8)  # the dispatch refuses more rows than slots (gdn_dispatch)
    rng = np.random.default_rng(seed)
    rnd = lambda *shape: rng.standard_normal(shape).astype(np.float32)  # noqa: E731
    as_dt = (lambda x: x.astype(ml_dtypes.bfloat16).astype(np.float32)) if dtype == "bf16" else (lambda x: x)
    x = rnd(S, T, 2 * Hk * dk + Hv * dv)
    mixed = as_dt(x / (1 + np.exp(-x)))
    b, a = as_dt(rnd(S, T, Hv)), as_dt(rnd(S, T, Hv) * 2)
    A_log, dt_bias = as_dt(rng.uniform(-1, 1, Hv).astype(np.float32)), as_dt(rnd(Hv))
    slots = rnd(S, B, n, Hv, dk, dv) * np.float32(0.1)
    rows = np.array([[-1 if s == fresh_stream else s * B + read_at, s * B] for s in range(S)], np.int32)
    work.mkdir(parents=True, exist_ok=True)
    np.array([S, T, Hk, Hv, dk, dv, layer, n, {"f32": 0, "bf16": 1}[dtype], f32_bits(dk ** -0.5, signed=True),
              int(every_row)], np.int32).tofile(work / "args.i32")
    for name, v in (("mixed", mixed), ("b", b), ("a", a), ("alog", A_log), ("dtb", dt_bias), ("slots", slots)):
        np.ascontiguousarray(v, np.float32).tofile(work / f"{name}.f32")
    rows.tofile(work / "rows.i32")
    subprocess.run([str(exe), str(work)], check=True, timeout=60)
    o = np.fromfile(work / "o.f32", np.float32).reshape(S, T, Hv, dv)
    got = np.fromfile(work / "slots_out.f32", np.float32).reshape(slots.shape)
    want_o, want_s = gdn_step(mixed, b, a, A_log, dt_bias, slots, rows, layer, Hk, dk, dtype,
                              every_row=every_row if ref_every_row is None else ref_every_row)
    return o, got, want_o, want_s


@pytest.fixture(scope="module")
def host_body(tmp_path_factory):
    return _build_host_body(tmp_path_factory.mktemp("gdn-host"))


# 2 streams (one fresh), a partial column block (dv 20: 8 + 8 + 4), bf16 at the 27B head dims; f32 with
# dk 8 (each warp's quarter 2 rows: two lanes' groups empty) and 16 rows
# dk 20: a warp's quarter of 5 rows in groups of 2, 2, 1 and 0
HOST_CASES = [(2, 5, 2, 4, 128, 20, "bf16"), (1, 16, 1, 2, 8, 8, "f32"), (1, 1, 2, 4, 128, 128, "bf16"),
              (1, 3, 1, 2, 20, 12, "f32")]


@pytest.mark.parametrize("case", HOST_CASES, ids=lambda c: "x".join(map(str, c)))
def test_host_body_equals_the_reference_bit_for_bit(host_body, tmp_path, case):
    """gdn_body.h itself, on the host: o and every slot (written rows and untouched ones) equal to
    reference.py's bits, the check bench/gdn_check.py makes on a GPU."""
    o, got, want_o, want_s = _run_host_body(host_body, tmp_path, *case, fresh_stream=1 if case[0] > 1 else None)
    assert np.array_equal(o.view(np.uint32), want_o.view(np.uint32))
    assert np.array_equal(got.view(np.uint32), want_s.view(np.uint32))


def test_host_body_last_state_only_equals_the_reference(host_body, tmp_path):
    """every_row 0 (a prefill's blocks): o as before, and only the last row's state written, to the
    row of slot 0, which is also the row it resumed from (a block after a block: read before written)."""
    o, got, want_o, want_s = _run_host_body(host_body, tmp_path, 2, 7, 2, 4, 128, 20, "bf16", every_row=False, read_at=0)
    assert np.array_equal(o.view(np.uint32), want_o.view(np.uint32))
    assert np.array_equal(got.view(np.uint32), want_s.view(np.uint32))


def test_host_body_check_catches_a_body_that_keeps_the_last_state_only(host_body, tmp_path):
    """Planted control: the body run with every_row 0 (the last row's state only, the form that times
    the rollback's writes) against the every-row reference keeps o's bits but fails the slots' check."""
    o, got, want_o, want_s = _run_host_body(host_body, tmp_path, 1, 4, 2, 4, 128, 20, "bf16", every_row=False,
                                            ref_every_row=True)
    assert np.array_equal(o.view(np.uint32), want_o.view(np.uint32))
    assert not np.array_equal(got.view(np.uint32), want_s.view(np.uint32))
