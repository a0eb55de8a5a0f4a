"""The one arch table: every compile target, its iree-compile flags, its runtime driver and the
custom kernels that exist for it.

Torch-free and IREE-free, so kernels/, export/ and runtime/ all read it. `resolve_arch` turns what
the user typed (`--arch`) into an `Arch`, aliases and the Hopper note included; `kernel_archs`
lists the archs one kernel has committed objects for (kernels/build.py builds exactly those).
"""

from __future__ import annotations

from dataclasses import dataclass

from dflash_iree.errors import DFlashError

KERNELS = ("topk", "gemm", "attention", "norm_rope", "gdn")  # the folders of kernels/
ATTENTION_FORMS = ("fused", "matmul")


@dataclass(frozen=True)
class Arch:
    """A compile target.

    name: the ARCH of `--arch` and of `compiled/ARCH/`. driver: the iree.runtime driver that runs
    its modules (local-task | hip | cuda). flags: the iree-compile flags. about: the hardware, for
    people. kernels: the custom kernels of kernels/ with objects for it (KERNELS' names).
    attention: the attention form the backend runs best (export/qwen3.py): IREE's fused attention op
    on GPUs ("fused"), matmul + softmax + matmul on the CPU ("matmul"), 1.5x faster there
    (docs/benchmarks.md, host demo). decode_steps: k of the `decode_steps` entry point a one-stream
    dense compile gets by default (plain decode steps in one call), 0 for none.
    """

    name: str
    driver: str
    flags: tuple[str, ...]
    about: str
    kernels: tuple[str, ...]
    attention: str = "fused"
    decode_steps: int = 0

    @property
    def backend(self) -> str:
        """The HAL backend of its executables: "cpu", "cuda" or "rocm"."""
        return {"local-task": "cpu", "cuda": "cuda", "hip": "rocm"}[self.driver]

    def has(self, kernel: str) -> bool:
        """Whether kernels/<kernel> has an object for this arch."""
        return kernel in self.kernels


# Row invariance on the host: without it IREE forms an RMSNorm and the matmul after it into
# different dispatches at 1 row than at 8, so decode and verify rounded one position's bf16 logits
# differently (7102 of the demo target's 8192) and drafted decoding parted from plain decoding. With
# the truncation fused into its consumers before dispatches form, every layer's row and the logits
# are the same bits at 1 and at 8 rows (experiments/2026-12-03-host-row-ops/;
# tests/test_row_invariance.py).
HOST_ROW_INVARIANT = ("--iree-dispatch-creation-enable-early-trunc-fusion=true",)


def _cpu(cpu: str, triple: str | None = None) -> tuple[str, ...]:
    flags = ("--iree-hal-target-device=local", "--iree-hal-local-target-device-backends=llvm-cpu")
    if triple:
        flags += (f"--iree-llvmcpu-target-triple={triple}",)
    return flags + (f"--iree-llvmcpu-target-cpu={cpu}", *HOST_ROW_INVARIANT)


# GPUs: global optimization at O3 fuses more per dispatch (Qwen3-8B decode 1308 -> 945 dispatches);
# on the H200 decode went 11.6 -> 10.5 ms and verify 26.0 -> 20.5 ms, exactness unchanged
# (docs/benchmarks.md, "Qwen3-8B shapes"). `--iree-opt-level=O3` and the aggressive dispatch-creation
# fusion flags cut further (656) but make the compile many times slower, so they are left out.
GPU_OPT = ("--iree-global-optimization-opt-level=O3",)
# Plain greedy decoding's steps a call on GPUs: the pinned CUDA HAL returns from each invocation only
# when its work is done, so the host's time between calls is paid once per k steps. At the Qwen3-8B
# shape on the H200 a token took 7.23 ms at k = 1, 6.91 at 2, 6.81 at 4 and 6.66 at 8, same tokens
# (experiments/2026-12-03-decode-steps/); in the pipelined path on an H100, k = 8 against 4 side by
# side was no slower: 0.990x the time a token, inside the 1% spread of its two rounds
# (experiments/2026-12-06-kv-write/speed_8b_k8_h100.json). The
# module barely grows (the steps share executables); the export traces each step, greedy 8 about a
# minute longer at 8B than 4 (sampled steps would add minutes more: greedy only). The HIP HAL is not
# measured (no AMD GPU here): the same k. The host keeps one step a call.
GPU_DECODE_STEPS = 8


def _hip(chip: str) -> tuple[str, ...]:
    return ("--iree-hal-target-device=hip", f"--iree-rocm-target={chip}", *GPU_OPT)


def _cuda(sm: str) -> tuple[str, ...]:
    return ("--iree-hal-target-device=cuda", f"--iree-cuda-target={sm}", *GPU_OPT)


# The pinned compiler's ROCm backend refuses `--iree-rocm-target=gfx1030` ("Unknown ROCM target"), though
# its GPU target table knows RDNA2; the device target is therefore given in full, with the values of that
# table (KnownTargets.cpp, getRDNA2WgpDetails: no MMA intrinsics, wave32/64, 64 KiB workgroup memory).
_GFX1030 = (
    '#hal.device.target<"hip", [#hal.executable.target<"rocm", "rocm-hsaco-fb", {abi = "hip", '
    'iree.encoding.resolver = #iree_gpu.gpu_encoding_resolver<>, iree_codegen.target_info = #iree_gpu.target<'
    'arch = "gfx1030", features = "", wgp = <compute = fp64|fp32|fp16|int64|int32|int16|int8, '
    'storage = b64|b32|b16|b8, subgroup = shuffle|arithmetic, dot = dp4xi8toi32, mma = [], '
    'subgroup_size_choices = [32, 64], max_workgroup_sizes = [1024, 1024, 1024], max_thread_count_per_workgroup = 1024, '
    'max_workgroup_memory_bytes = 65536, max_workgroup_counts = [2147483647, 2147483647, 2147483647]>>, '
    'ukernels = "none"}>]>')

# The skinny GEMM needs matrix instructions (mma.sync, WMMA): gfx1030 has none. The attention and the
# norm + rope and the Gated DeltaNet step are plain f32 arithmetic, so every GPU has them; the host keeps
# IREE's own lowering for all four and runs only the top-K kernel.
_HOST = ("topk",)
_RDNA2 = ("topk", "attention", "norm_rope", "gdn")
_GPU = ("topk", "gemm", "attention", "norm_rope", "gdn")


def _gpu(name: str, driver: str, flags: tuple[str, ...], about: str, kernels: tuple[str, ...]) -> Arch:
    """A GPU arch: IREE's fused attention op and GPU_DECODE_STEPS plain decode steps a call."""
    return Arch(name, driver, flags, about, kernels, decode_steps=GPU_DECODE_STEPS)


ARCHS: dict[str, Arch] = {a.name: a for a in (
    Arch("host", "local-task", _cpu("host"), "llvm-cpu for this machine's CPU", _HOST, attention="matmul"),
    _gpu("gfx1030", "hip", (f"--iree-hal-target-device={_GFX1030}", *GPU_OPT), "RDNA2 (RX 6800/6900)", _RDNA2),
    _gpu("gfx1100", "hip", _hip("gfx1100"), "RDNA3 (RX 7900 XTX/XT, W7900)", _GPU),
    _gpu("gfx1151", "hip", _hip("gfx1151"), "RDNA3.5 (Strix Halo, Ryzen AI Max)", _GPU),
    _gpu("gfx1201", "hip", _hip("gfx1201"), "RDNA4 (RX 9070 XT)", _GPU),
    _gpu("sm_80", "cuda", _cuda("sm_80"), "Ampere (A100); its PTX also runs on Hopper", _GPU),
    _gpu("sm_86", "cuda", _cuda("sm_86"), "Ampere (RTX 30xx, A10, A40)", _GPU),
    _gpu("sm_89", "cuda", _cuda("sm_89"), "Ada (RTX 40xx, L4, L40S)", _GPU),
)}

_HOPPER = ("the pinned iree-base-compiler 3.13 has no sm_90 target (iree-org/iree#22147); sm_80 PTX is "
           "JIT-compiled for Hopper by the CUDA driver when the module loads")
ALIASES: dict[str, tuple[str, str]] = {
    "strix-halo": ("gfx1151", ""),
    "rx7900xtx": ("gfx1100", ""),
    "h100": ("sm_80", _HOPPER),
    "h200": ("sm_80", _HOPPER),
}
# Names people try that have no target, with the way that works instead.
MISSING: dict[str, str] = {
    "sm_90": f"{_HOPPER}: use --arch h200 or h100 (sm_80)",
    "sm_90a": f"{_HOPPER}: use --arch h200 or h100 (sm_80)",
}

# The host record is made for a fixed, named CPU, not this machine's features, so that it
# is the same on every machine that makes it.
RECORD_HOST_FLAGS = _cpu("x86-64-v3", "x86_64-unknown-linux-gnu")


def resolve_arch(name: str) -> tuple[Arch, str]:
    """An ARCH name or alias -> (Arch, note for the user, "" when none).

    Raises:
        DFlashError: sm_90 / sm_90a (no such target in the pinned compiler; the message says to use
            h200 / h100), or an unknown name, listing the accepted ones.
    """
    key = name.strip().lower()
    if key in ARCHS:
        return ARCHS[key], ""
    if key in ALIASES:
        real, note = ALIASES[key]
        return ARCHS[real], f"{name} -> {real}" + (f": {note}" if note else "")
    if key in MISSING:
        raise DFlashError(f"--arch {name}: {MISSING[key]}")
    accepted = ", ".join(ARCHS) + "; aliases: " + ", ".join(f"{a} ({r})" for a, (r, _) in ALIASES.items())
    raise DFlashError(f"unknown ARCH '{name}'; accepted: {accepted}")


def compile_flags(arch: Arch, record: bool = False) -> list[str]:
    """The exact iree-compile flags for an arch; `record` swaps host's CPU for the fixed record CPU."""
    flags = RECORD_HOST_FLAGS if record and arch.name == "host" else arch.flags
    return list(flags)


def kernel_archs(kernel: str, driver: str | None = None) -> tuple[str, ...]:
    """The archs that kernels/<kernel> has objects for, CUDA first, then ROCm, then the host (the
    order of the kernel folders' ARCHS); only those of `driver` when given."""
    if kernel not in KERNELS:
        raise ValueError(f"unknown kernel {kernel!r}; kernels: {', '.join(KERNELS)}")
    order = {"cuda": 0, "hip": 1, "local-task": 2}
    found = [a for a in ARCHS.values() if a.has(kernel) and driver in (None, a.driver)]
    return tuple(a.name for a in sorted(found, key=lambda a: order[a.driver]))
