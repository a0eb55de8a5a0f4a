"""The graph's argmax (export/sampling.py `argmax`): torch.argmax's first index, for one row in two
levels (the row padded with -inf to whole chunks), for several in one; eager and compiled by IREE
for the host, with ties across chunks, -0 against +0, infinities and NaN rows; and a planted
control that takes the last chunk."""

from __future__ import annotations

import subprocess

import numpy as np
import pytest
import torch

from dflash_iree.export.iree_tool import iree_compile_tool
from dflash_iree.export.sampling import ARGMAX_CHUNK, _argmax_flat, argmax


def _cases(V: int, seed: int = 0) -> torch.Tensor:
    """float32 [14, V] rows, most with the maximum tied across chunks (integers: many ties)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(14, V, generator=g).round()
    c = ARGMAX_CHUNK if _levels(V) == 2 else V // 4  # one level: still past the first quarter
    for r in range(6):  # the maximum in several chunks, the first not in chunk 0
        for i in torch.randint(c, V, (3,), generator=g):
            x[r, i] = 50.0
    x[6] = -0.0
    x[6, V - 1] = 0.0  # -0 == +0: the first index, not the larger bits
    x[7] = float("-inf")
    x[8, V // 2] = float("nan")
    x[9, V // 3] = -float("nan")
    x[10, V - 1] = float("inf")
    x[10, c + 1] = float("inf")
    x[12, V - 1] = 100.0  # the only maximum, in the last (padded) chunk
    x[13, V - 1] = float("nan")  # a NaN in the last chunk only
    return x


def _levels(V: int) -> int:
    return 2 if -(-V // ARGMAX_CHUNK) >= 8 else 1


def _reference(x: torch.Tensor) -> torch.Tensor:
    """torch.argmax, with the documented V for a row holding NaN."""
    return torch.where(x.isnan().any(-1), torch.full(x.shape[:-1], x.shape[-1]), x.argmax(-1))


def _argmax_last_chunk(x: torch.Tensor) -> torch.Tensor:
    """A planted control: the two levels with the *last* chunk holding the maximum chosen."""
    V, c = x.shape[-1], ARGMAX_CHUNK
    n = -(-V // c)
    xc = torch.nn.functional.pad(x, (0, n * c - V), value=float("-inf")).reshape(*x.shape[:-1], n, c)
    m = xc.amax(-1)
    local = _argmax_flat(xc)
    last = torch.where(m == m.amax(-1, keepdim=True), torch.arange(n), torch.full_like(local, -1)).amax(-1)
    return last * c + local.gather(-1, last.clamp(min=0)[..., None])[..., 0]


@pytest.mark.parametrize("V", [151936, 248320, 40000, 32768, 8192, 1000])
def test_argmax_is_torch_first_index(V):
    x = _cases(V)
    assert _levels(V) == {151936: 2, 248320: 2, 40000: 2, 32768: 2, 8192: 1, 1000: 1}[V]
    for r in range(len(x)):  # one row: two levels where V has 8 chunks
        assert torch.equal(argmax(x[r:r + 1]), _reference(x[r:r + 1])), r
        assert torch.equal(argmax(x[r].reshape(1, 1, V)), _reference(x[r:r + 1]).reshape(1, 1))
    assert torch.equal(argmax(x), _reference(x))  # several rows: one level
    assert torch.equal(argmax(x.reshape(2, 7, V)), _reference(x).reshape(2, 7))


def test_the_cases_catch_a_broken_two_level_argmax():
    x = _cases(151936)
    assert not torch.equal(_argmax_last_chunk(x[:6]), _reference(x[:6]))


def test_argmax_compiled_for_the_host_equals_eager(tmp_path):
    aot = pytest.importorskip("iree.turbine.aot")
    import iree.runtime as rt

    class Choose(torch.nn.Module):
        def forward(self, x):
            return argmax(x)

    x = _cases(40000, seed=1)  # one row at a time: two levels, the last chunk padded
    aot.export(Choose(), args=(torch.zeros_like(x[:1]),)).save_mlir(tmp_path / "m.mlir")
    subprocess.run([iree_compile_tool(), str(tmp_path / "m.mlir"), "-o", str(tmp_path / "m.vmfb"),
                    "--iree-hal-target-device=local", "--iree-hal-local-target-device-backends=llvm-cpu"], check=True)
    cfg = rt.Config("local-task")
    ctx = rt.SystemContext(config=cfg)
    ctx.add_vm_module(rt.VmModule.mmap(cfg.vm_instance, str(tmp_path / "m.vmfb")))
    got = np.concatenate([np.asarray(ctx.modules.module["main"](x[r:r + 1].numpy())) for r in range(len(x))])
    assert np.array_equal(got, _reference(x).numpy())
