"""What the lowerings of export/lower_*.py share: the record of what one did (`Lowered`) and the
arch table's answer to whether an arch has a kernel (`has_kernel`, dflash_iree/arch.py)."""

from __future__ import annotations

from dataclasses import dataclass, field

from dflash_iree.arch import ARCHS


def has_kernel(arch: str, kernel: str) -> bool:
    """Whether ARCH (an ARCH name) has KERNEL ("topk", "gemm", "attention", "norm_rope") in the arch table."""
    a = ARCHS.get(arch)
    return a is not None and a.has(kernel)


@dataclass
class Lowered:
    """What one lowering did to a module (export/splice.py `splice_file` gathers them into its report).

    flags:   iree-compile flags its kernels need (the object search path).
    entries: one dict per kernel shape it placed, with the call count (`ops`).
    iree:    reason -> how many ops (for the linears: weights) it gave to IREE for that reason.
    rule:    the arch's rule for these ops (whether the arch has the kernel, the floors).
    """

    flags: list[str] = field(default_factory=list)
    entries: list[dict] = field(default_factory=list)
    iree: dict[str, int] = field(default_factory=dict)
    rule: dict = field(default_factory=dict)
