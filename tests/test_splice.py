"""export/splice.py, export/mlir.py and the top-K named op of export/ops.py, on small hand-made modules (the tiny pair's
draft_topk, spliced and compiled, is tested in test_compile.py and test_runtime.py)."""

from __future__ import annotations

import functools
import re

import numpy as np
import pytest
import torch

from dflash_iree.errors import DFlashError
from dflash_iree.export import mlir, splice
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
    assert mlir.builtin_type(torch_type) == builtin


def test_builtin_type_refuses_other_types():
    with pytest.raises(DFlashError, match="not a !torch.vtensor"):
        mlir.builtin_type("!torch.int")
    with pytest.raises(DFlashError, match="dynamic dim"):
        mlir.static_shape("!torch.vtensor<[?,4],f32>")


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
    ops = mlir.find_ops(module, "torch.aten.mm")
    if not ops:
        return None
    mlir.add_functions(module, _MATMUL)
    for op in ops:
        mlir.replace_with_call(op, "my_mm")
    return splice.Lowered()


def test_splice_file_compiles_and_runs(tmp_path):
    src = tmp_path / "m.mlir"
    src.write_text(_MODULE)
    out, flags, report = splice.splice_file(src, tmp_path / "s.mlirbc", "host", {"mm": _splice_mm, "topk": splice.lower_topk})
    assert out == tmp_path / "s.mlirbc" and len(flags) == 1 and "object-search-path" in flags[0]
    text = str(splice.load(out))
    assert "torch.aten.mm" not in text and "torch.operator" not in text
    assert "util.call @my_mm" in text and "util.call @dflash_topk_4x64x3_op" in text
    assert report["topk"] == [{"n": 4, "V": 64, "K": 3, "ops": 1}]
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
    assert splice.splice_file(src, tmp_path / "s.mlirbc", "host", {"topk": splice.lower_topk}) == (src, [], {})
    assert not (tmp_path / "s.mlirbc").exists()


def test_add_functions_keeps_symbols_once():
    from iree.compiler import ir

    module = ir.Module.parse(_MODULE, ir.Context())
    assert mlir.add_functions(module, _MATMUL) == ["my_mm"]
    assert mlir.add_functions(module, _MATMUL) == []
    assert str(module).count("util.func private @my_mm") == 1
    with pytest.raises(DFlashError, match="does not parse"):
        mlir.add_functions(module, "util.func private @broken(")


def test_topk_splice_refuses_an_arch_without_object(tmp_path):
    from iree.compiler import ir

    module = ir.Module.parse(_MODULE, ir.Context())
    with pytest.raises(DFlashError, match="unknown arch"):
        splice.lower_topk(module, "sm_90")


# ---------------------------------------------------------------- the guard: kernels placed by name

def _variant_cache_attention(q, cache, layer, read_len, positions, attention):
    """export/qwen3.py `cache_attention` with another cache read (a gather of the rows instead of a
    slice and view) before the named op: the lowering must not care."""
    import torch

    from dflash_iree.export import ops, qwen3

    S, hd = cache.shape[0], q.shape[-1]
    hkv = cache.shape[-1] // hd
    rows = torch.arange(read_len, dtype=torch.int64, device=q.device)
    keys, values = (cache[:, layer, i].index_select(1, rows).reshape(S, read_len, hkv, hd) for i in (0, 1))
    visible = torch.arange(read_len, dtype=torch.int64, device=q.device)[None, None, :] <= positions[:, :, None]
    out = qwen3.attention_fn(attention)(q, keys, values, visible)
    return ops.block_attention(q, cache, layer, qwen3.query_rows_mask(visible, q.shape[2] // hkv), out)


def _variant_qkv(self, x, cos, sin):
    """Attention.qkv with another linear layout: the projections in the order v, q, k, reshaped, not viewed."""
    from dflash_iree.export import qwen3

    S, T, _ = x.shape
    v, q, k = qwen3.project(x, (self.v_proj, self.q_proj, self.k_proj))
    q = qwen3.norm_rope(self.q_norm, q.reshape(S, T, -1, self.cfg.head_dim), cos, sin, self.attention)
    return (q, *self.rotate_kv(k.contiguous(), v.contiguous(), cos, sin))


def _bypassed_cache_attention(q, cache, layer, read_len, positions, attention):
    """The planted control: the model's attention without the named op (a silent fallback)."""
    import torch

    from dflash_iree.export import qwen3

    hd = q.shape[-1]
    S, hkv = cache.shape[0], cache.shape[-1] // hd
    keys = cache[:, layer, 0, :read_len].view(S, read_len, hkv, hd)
    values = cache[:, layer, 1, :read_len].view(S, read_len, hkv, hd)
    visible = torch.arange(read_len, dtype=torch.int64, device=q.device)[None, None, :] <= positions[:, :, None]
    return qwen3.attention_fn(attention)(q, keys, values, visible)


def _kernels_missing(text: str, layers: int) -> list[str]:
    """What the lowered verify lacks of one kernel call per layer and op (and the lm_head's GEMM)."""
    body = text[text.index("func.func @verify("):]
    body = body[:body.index("\n  }\n")]
    want = {"dflash_attention_": layers, "dflash_norm_rope_": layers, "dflash_gemm_": 4 * layers + 1}
    got = {k: len(re.findall(rf"util\.call @{k}\w*\(", body)) for k in want}
    return [f"{k}: {got[k]} calls, want {n}" for k, n in want.items() if got[k] != n]


@pytest.mark.parametrize("variant", ["model", "other layout", "bypassed (planted control)"])
def test_the_lowering_places_every_kernel_by_name(variant, target_dir, drafter_dir, tmp_path, monkeypatch):
    """The tiny target in bf16, its verify exported with the model's cache read and linear layout, or
    another (`_variant_*`), and lowered for sm_80 with the floors at 0 and `strict`: every named op
    takes its kernel, or the lowering fails naming it. The planted control bypasses the attention's
    named op: the kernel count must catch it."""
    from dflash_iree.config import load_drafter_config, load_target_config
    from dflash_iree.export import aot, qwen3

    if variant == "other layout":
        monkeypatch.setattr(qwen3, "cache_attention", _variant_cache_attention)
        monkeypatch.setattr(qwen3.Attention, "qkv", _variant_qkv)
    elif variant != "model":
        monkeypatch.setattr(qwen3, "cache_attention", _bypassed_cache_attention)
    tcfg = load_target_config(target_dir)
    pair = aot.build_pair(tcfg, load_drafter_config(drafter_dir, tcfg), 256, 8, 1, torch.bfloat16)
    shapes = aot.ExportShapes(1, 8, 256, "bf16", pair.drafter.cfg.num_taps * tcfg.hidden_size)
    with torch.no_grad():
        out, _ = aot.export_module(pair, shapes, sampled=False, only=("verify",))
    out.save_mlir(tmp_path / "m.mlir")
    floors = {**splice.LOWERINGS, "gemm": functools.partial(splice.lower_linear, min_weight_bytes=0),
              "attention": functools.partial(splice.lower_attention, min_rows=1)}
    spliced, _, report = splice.splice_file(tmp_path / "m.mlir", tmp_path / "s.mlirbc", "sm_80", floors, strict=True)
    missing = _kernels_missing(str(splice.load(spliced)), tcfg.num_hidden_layers)
    if variant.startswith("bypassed"):
        assert missing == [f"dflash_attention_: 0 calls, want {tcfg.num_hidden_layers}"]
    else:
        assert missing == [] and "iree" not in report


def test_strict_names_the_op_given_to_iree(tmp_path):
    """With `strict`, an op that the arch's rules give to IREE on an arch that has its kernel fails loudly."""
    aot = pytest.importorskip("iree.turbine.aot")
    from dflash_iree.export import qwen3

    class One(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Linear(64, 32, bias=False, dtype=torch.bfloat16)

        def forward(self, x):
            return qwen3.project(x, [self.w])[0]

    m = One()
    aot.externalize_module_parameters(m)
    aot.export(m, args=(torch.zeros(1, 65, 64, dtype=torch.bfloat16),)).save_mlir(tmp_path / "m.mlir")
    with pytest.raises(DFlashError, match="gemm gave ops to IREE on sm_80.*M=65 rows outside 1..64"):
        splice.splice_file(tmp_path / "m.mlir", tmp_path / "s.mlirbc", "sm_80", strict=True)
    _, _, report = splice.splice_file(tmp_path / "m.mlir", tmp_path / "s.mlirbc", "host", strict=True)
    assert report["iree"]["gemm"] == {"arch host has no skinny GEMM kernel": 1}
