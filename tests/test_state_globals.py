"""Module state globals keep separate storage after iree-compile (export/aot.py `_finish_globals`).

IREE 3.13 gives two mutable globals of one type and one splat initial value one storage when both
are updated in place: writing rows of one writes the other. The hybrid demo pair hit it (its target's
two attention layers' KV cache and its 2-layer drafter's context cache are both [1, 2, 2, 512, 128]
bf16): the drafter's `absorb` overwrote the target's keys and values, and drafted != plain.
`_finish_globals` gives the second of a type -0.0. The planted control keeps +0.0 for both and must
leak; the probe of IREE itself says when the pin no longer needs the workaround.
"""

from __future__ import annotations

import numpy as np
import pytest

iree_compiler = pytest.importorskip("iree.compiler")

from dflash_iree.errors import DFlashError  # noqa: E402
from dflash_iree.export.aot import _STATE_SCOPE, _finish_globals  # noqa: E402

# two caches of one type as the importer emits them (tagged `state`), each updated in place
MODULE = """
module @m {{
  util.global private mutable @a = {a} : tensor<8xf32>
  util.global private mutable @b = {b} : tensor<8xf32>
  func.func @write_a(%x: tensor<4xf32>, %i: index) {{
    %0 = util.global.load @a : tensor<8xf32>
    %1 = tensor.insert_slice %x into %0[%i] [4] [1] : tensor<4xf32> into tensor<8xf32>
    util.global.store %1, @a : tensor<8xf32>
    return
  }}
  func.func @write_b(%x: tensor<4xf32>, %i: index) {{
    %0 = util.global.load @b : tensor<8xf32>
    %1 = tensor.insert_slice %x into %0[%i] [4] [1] : tensor<4xf32> into tensor<8xf32>
    util.global.store %1, @b : tensor<8xf32>
    return
  }}
  func.func @read_b() -> tensor<8xf32> {{
    %0 = util.global.load @b : tensor<8xf32>
    return %0 : tensor<8xf32>
  }}
}}
"""
TAGGED = '#flow.parameter.named<"{scope}"::"{name}">'


def _tagged(name: str) -> str:
    return TAGGED.format(scope=_STATE_SCOPE, name=name)


def _leaks(text: str) -> bool:
    """Compile for the host, write b's first half and then a's second: does b see a's rows?"""
    import iree.runtime as rt

    vmfb = iree_compiler.compile_str(text, target_backends=["llvm-cpu"],
                                     extra_args=["--iree-llvmcpu-target-cpu=host"])
    config = rt.Config("local-task")
    ctx = rt.SystemContext(config=config)
    ctx.add_vm_module(rt.VmModule.copy_buffer(config.vm_instance, vmfb))
    m = ctx.modules.m
    m.write_b(np.full(4, 5, np.float32), 0)
    m.write_a(np.arange(1, 5, dtype=np.float32), 4)
    return bool(np.any(m.read_b().to_host()[4:] != 0))


def _finished(planted: bool = False) -> str:
    """MODULE after _finish_globals (planted: after the rule it replaced, zeros for every global)."""
    from iree.compiler import ir

    with ir.Context() as ctx:
        ctx.allow_unregistered_dialects = True
        module = ir.Module.parse(MODULE.format(a=_tagged("a"), b=_tagged("b")))
        if planted:
            with ir.Location.unknown():
                for op in module.body.operations:
                    if op.operation.name == "util.global":
                        ty = ir.TypeAttr(op.attributes["type"]).value
                        zero = ir.FloatAttr.get(ir.RankedTensorType(ty).element_type, 0.0)
                        op.attributes["initial_value"] = ir.DenseElementsAttr.get_splat(ty, zero)
        else:
            _finish_globals(module.operation)
        return str(module)


def test_iree_still_aliases_equal_splats():
    """The IREE behaviour the workaround is for. If this fails, the pinned IREE keeps such globals
    apart: the -0.0 rule may go (and this test with it)."""
    assert _leaks(MODULE.format(a="dense<0.0>", b="dense<0.0>"))


def test_finish_globals_keeps_state_apart():
    assert not _leaks(_finished())


def test_planted_equal_zeros_leak():
    """The planted control: every state global +0.0, the rule before the fix."""
    assert _leaks(_finished(planted=True))


def test_a_third_cache_of_one_type_is_refused():
    from iree.compiler import ir

    text = MODULE.format(a=_tagged("a"), b=_tagged("b")).replace(
        "  func.func @write_a", f"  util.global private mutable @c = {_tagged('c')} : tensor<8xf32>\n  func.func @write_a", 1)
    with ir.Context() as ctx:
        ctx.allow_unregistered_dialects = True
        module = ir.Module.parse(text)
        with pytest.raises(DFlashError, match="a, b, c are all tensor<8xf32>"):
            _finish_globals(module.operation)
