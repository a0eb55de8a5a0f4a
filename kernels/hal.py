"""The HAL text every kernel's dispatch builder shares: executable targets, pipeline layouts, the
`hal.executable.source` head, the committed object paths and the flags of a standalone module.

A kernel folder (kernels/<name>/dispatch.py) writes its own push constants, bindings and
`flow.dispatch`; what an executable bound to a committed object looks like is written here once.
The archs and their drivers come from dflash_iree/arch.py. No IREE import: this module only
writes text.
"""

from __future__ import annotations

import platform
import struct
from pathlib import Path

from dflash_iree.arch import ARCHS
from dflash_iree.errors import DFlashError

OBJECTS_DIR = Path(__file__).resolve().parent / "objects"


def host_object_arch() -> str:
    """The embedded-ELF architecture of this machine ('x86_64' or 'arm_64'), as IREE names it.
    Raises DFlashError on another machine."""
    m = platform.machine().lower()
    if m in ("x86_64", "amd64"):
        return "x86_64"
    if m in ("aarch64", "arm64"):
        return "arm_64"
    raise DFlashError(f"the top-K kernel has no host object for machine '{m}' (x86_64 and aarch64 only)")


def _driver(arch: str) -> str | None:
    return ARCHS[arch].driver if arch in ARCHS else None


def executable_target(arch: str) -> str:
    """The generic executable target of ARCH's backend that the objects are keyed by (the host's:
    this machine's embedded ELF)."""
    driver = _driver(arch)
    if driver == "cuda":
        return '#hal.executable.target<"cuda", "cuda-nvptx-fb">'
    if driver == "local-task":
        return f'#hal.executable.target<"llvm-cpu", "embedded-elf-{host_object_arch()}">'
    return '#hal.executable.target<"rocm", "rocm-hsaco-fb">'


def gpu_object(kernel: str, arch: str, archs: tuple[str, ...], what: str) -> Path:
    """Committed object of KERNEL (its file prefix) for ARCH: PTX for sm_*, a code object for gfx*.
    Raises DFlashError, naming WHAT, for an arch outside ARCHS."""
    if arch not in archs:
        raise DFlashError(f"no {what} kernel for arch '{arch}'; GPU archs only: {', '.join(archs)}")
    return OBJECTS_DIR / (f"{kernel}_{arch}.ptx" if _driver(arch) == "cuda" else f"{kernel}_{arch}.co")


def search_flags() -> list[str]:
    """What `iree-compile` needs besides the device target to find the objects."""
    return [f"--iree-hal-executable-object-search-path={OBJECTS_DIR}"]


def pipeline_layout(constants: int, read_only: int, bindings: int) -> str:
    """A `#hal.pipeline.layout`: CONSTANTS push constants, BINDINGS buffers of which the first READ_ONLY are read-only."""
    b = (["#hal.pipeline.binding<storage_buffer, ReadOnly>"] * read_only
         + ["#hal.pipeline.binding<storage_buffer>"] * (bindings - read_only))
    return f"#hal.pipeline.layout<constants = {constants}, bindings = [{', '.join(b)}]>"


def entry_attribute(entry: str) -> str:
    """The attributes that keep an executable of ENTRY apart from those of the object's other entry
    points: iree-compile deduplicates executables that differ only in their export's name (it takes
    it for a symbol), so two dispatches of one object with the same layout and workgroup count,
    e.g. `dflash_gemm_mt1` and `dflash_gemm_mt2`, would otherwise both launch one of them."""
    return f'attributes {{dflash.entry = "{entry}"}}'


def executable_head(sym: str, entry: str, target: str, obj: str, layout: str, workload: int) -> str:
    """The start of a `hal.executable.source` @SYM for TARGET (an executable target attribute) that
    exports ENTRY of object OBJ, whose workgroup count is its first WORKLOAD workload values (the
    rest 1): up to the export's count region, which the caller follows with the export's properties
    (a GPU's workgroup size) or a CPU body, then closes with "}"."""
    wl = "".join(f", %w{i}: index" for i in range(workload))
    count = ", ".join([f"%w{i}" for i in range(workload)] + ["%c1"] * (3 - workload))
    return (f"hal.executable.source private @{sym} <objects = <{{{target} = "
            f"[#hal.executable.object<{{path = \"{obj}\"}}>]}}>> {entry_attribute(entry)} {{\n"
            f"  hal.executable.export public @{entry} ordinal(0) layout({layout})"
            f" count(%device: !hal.device{wl}) -> (index, index, index) {{\n"
            f"    %c1 = arith.constant 1 : index\n    hal.return {count} : index, index, index\n  }}")


def executable_source(sym: str, entry: str, arch: str, obj: str, layout: str, threads: int, workload: int) -> str:
    """A `hal.executable.source` @SYM exporting ENTRY of object OBJ on GPU ARCH, THREADS threads a
    workgroup, whose workgroup count is its first WORKLOAD workload values (the rest 1)."""
    return (executable_head(sym, entry, executable_target(arch), obj, layout, workload)
            + f" <workgroup_size = [{threads} : index, 1 : index, 1 : index]>\n}}\n")


def f32_bits(x: float, signed: bool = False) -> int:
    """The bits of x rounded to float32, as an unsigned (or, for an i32 push constant, signed) int."""
    return struct.unpack("<i" if signed else "<I", struct.pack("<f", x))[0]


def device_flags(arch: str) -> list[str]:
    """iree-compile flags that select ARCH's device (what standalone modules and benchmarks use;
    the compile pipeline's own are dflash_iree/arch.py's). Raises DFlashError for an unknown arch."""
    driver = _driver(arch)
    if driver == "cuda":
        return ["--iree-hal-target-device=cuda", f"--iree-cuda-target={arch}"]
    if driver == "hip":
        return ["--iree-hal-target-device=hip", f"--iree-rocm-target={arch}"]
    if driver == "local-task":
        return ["--iree-hal-target-device=local", "--iree-hal-local-target-device-backends=llvm-cpu",
                "--iree-llvmcpu-target-cpu=host"]
    raise DFlashError(f"unknown arch '{arch}' for the kernels; known: {', '.join(ARCHS)}")
