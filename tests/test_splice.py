"""export/splice.py and the custom op of export/ops.py, on small hand-made modules (the tiny pair's
draft_topk, spliced and compiled, is tested in test_compile.py and test_runtime.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dflash_iree.errors import DFlashError
from dflash_iree.export import splice
from dflash_iree.export.ops import topk_logprobs, top_k_per_stream
from dflash_iree.kernels.topk.reference import make_logits, reference, score
from dflash_iree.kernels.topk import device_flags

ic = pytest.importorskip("iree.compiler")
rt = pytest.importorskip("iree.runtime")


def test_eager_op_matches_the_kernel_reference():
    """Ids in the reference's order (planted ties: lower id first), log-probs of log_softmax(x / T)."""
    x = make_logits(5, 700, 8, np.random.default_rng(4))
    for T in (1.0, 0.6):
        ids, lps = topk_logprobs(torch.from_numpy(x), torch.tensor(T), 8)
        assert ids.dtype == torch.int32 and lps.dtype == torch.float32 and ids.shape == (5, 8)
        want, lsm = reference(x, 8, T)
        assert ids.numpy().tolist() == want.tolist()
        assert np.abs(lps.numpy() - np.take_along_axis(lsm, want, 1)).max() < 1e-6
        assert score(x, T, ids.numpy(), lps.numpy())["tie_swap"] == 0


def test_eager_op_per_stream():
    x = torch.randn(2, 3, 50)
    ids, lps = top_k_per_stream(x, torch.tensor([1.0, 2.0]), 4)
    assert ids.shape == lps.shape == (2, 3, 4)
    assert torch.equal(ids[1], topk_logprobs(x[1], torch.tensor(2.0), 4)[0])
    assert torch.equal(ids[..., 0].long(), x.argmax(-1))


@pytest.mark.parametrize("torch_type, builtin", [
    ("!torch.vtensor<[7,512],f32>", "tensor<7x512xf32>"),
    ("!torch.vtensor<[],f32>", "tensor<f32>"),
    ("!torch.vtensor<[1,?,8],si64>", "tensor<1x?x8xi64>"),
    ("!torch.vtensor<[3],bf16>", "tensor<3xbf16>"),
])
def test_builtin_type(torch_type, builtin):
    assert splice.builtin_type(torch_type) == builtin


def test_builtin_type_refuses_other_types():
    with pytest.raises(DFlashError, match="not a !torch.vtensor"):
        splice.builtin_type("!torch.int")
    with pytest.raises(DFlashError, match="dynamic dim"):
        splice.static_shape("!torch.vtensor<[?,4],f32>")


# A torch-dialect module as the FX importer writes it: a matmul (replaced with a hand-written
# function, the way a GEMM splice would) and the top-K op.
_MODULE = """
module @m {
  func.func @f(%x: !torch.vtensor<[4,16],f32>, %w: !torch.vtensor<[16,64],f32>, %t: !torch.vtensor<[],f32>)
      -> (!torch.vtensor<[4,3],si32>, !torch.vtensor<[4,3],f32>) {
    %0 = torch.aten.mm %x, %w : !torch.vtensor<[4,16],f32>, !torch.vtensor<[16,64],f32> -> !torch.vtensor<[4,64],f32>
    %k = torch.constant.int 3
    %1:2 = torch.operator "torch.dflash.topk_logprobs"(%0, %t, %k) : (!torch.vtensor<[4,64],f32>, !torch.vtensor<[],f32>, !torch.int) -> (!torch.vtensor<[4,3],si32>, !torch.vtensor<[4,3],f32>)
    return %1#0, %1#1 : !torch.vtensor<[4,3],si32>, !torch.vtensor<[4,3],f32>
  }
}
"""

_MATMUL = """
util.func private @my_mm(%a: tensor<4x16xf32>, %b: tensor<16x64xf32>) -> tensor<4x64xf32> {
  %z = arith.constant 0.0 : f32
  %e = tensor.empty() : tensor<4x64xf32>
  %f = linalg.fill ins(%z : f32) outs(%e : tensor<4x64xf32>) -> tensor<4x64xf32>
  %r = linalg.matmul ins(%a, %b : tensor<4x16xf32>, tensor<16x64xf32>) outs(%f : tensor<4x64xf32>) -> tensor<4x64xf32>
  util.return %r : tensor<4x64xf32>
}
"""


def _splice_mm(module, arch):
    ops = splice.find_ops(module, "torch.aten.mm")
    if not ops:
        return None
    splice.add_functions(module, _MATMUL)
    for op in ops:
        splice.replace_with_call(op, "my_mm")
    return []


def test_splice_file_compiles_and_runs(tmp_path):
    src = tmp_path / "m.mlir"
    src.write_text(_MODULE)
    out, flags = splice.splice_file(src, tmp_path / "s.mlirbc", "host", {"mm": _splice_mm, "topk": splice.splice_topk})
    assert out == tmp_path / "s.mlirbc" and len(flags) == 1 and "object-search-path" in flags[0]
    text = str(splice.load(out))
    assert "torch.aten.mm" not in text and "torch.operator" not in text
    assert "util.call @my_mm" in text and "util.call @dflash_topk_4x64x3_op" in text
    assert splice.last_report()["topk"] == [{"n": 4, "V": 64, "K": 3, "ops": 1}]
    vmfb = ic.compile_file(str(out), extra_args=device_flags("host") + flags)
    config = rt.Config("local-task")
    ctx = rt.SystemContext(config=config)
    ctx.add_vm_module(rt.VmModule.copy_buffer(config.vm_instance, vmfb))
    g = np.random.default_rng(0)
    x, w = g.standard_normal((4, 16)).astype(np.float32), g.standard_normal((16, 64)).astype(np.float32)
    ids, lps = ctx.modules.m.f(x, w, np.array(0.8, np.float32))
    logits = torch.from_numpy(x) @ torch.from_numpy(w)
    s = score(logits.numpy(), 0.8, np.asarray(ids), np.asarray(lps))
    assert s["id_mismatch"] == 0 and s["max_lp_err"] < 1e-4


def test_nothing_to_splice_writes_nothing(tmp_path):
    src = tmp_path / "m.mlir"
    src.write_text(_MODULE.replace('torch.operator "torch.dflash.topk_logprobs"', 'torch.operator "torch.other.op"'))
    assert splice.splice_file(src, tmp_path / "s.mlirbc", "host", {"topk": splice.splice_topk}) == (src, [])
    assert not (tmp_path / "s.mlirbc").exists()


def test_add_functions_keeps_symbols_once():
    from iree.compiler import ir

    module = ir.Module.parse(_MODULE, ir.Context())
    assert splice.add_functions(module, _MATMUL) == ["my_mm"]
    assert splice.add_functions(module, _MATMUL) == []
    assert str(module).count("util.func private @my_mm") == 1
    with pytest.raises(DFlashError, match="does not parse"):
        splice.add_functions(module, "util.func private @broken(")


def test_topk_splice_refuses_an_arch_without_object(tmp_path):
    from iree.compiler import ir

    module = ir.Module.parse(_MODULE, ir.Context())
    with pytest.raises(DFlashError, match="unknown arch"):
        splice.splice_topk(module, "sm_90")
