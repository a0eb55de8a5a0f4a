"""Inspection of the committed kernel objects without any toolchain: ELF symbols, AMDGPU metadata, PTX header.

An AMD code object is an ELF whose NT_AMDGPU_METADATA note is a MessagePack map with one entry
per kernel (register counts, spills, scratch size). Reading it here lets CI check on a bare
machine that every gfx object holds both kernels for the right chip, with no scratch and no spills.
Formats: the ELF-64 gABI, the AMDGPU section of the LLVM docs (AMDGPUUsage: code object V5
metadata, EF_AMDGPU_MACH values), and the MessagePack spec.
"""

from __future__ import annotations

import re
import struct
from pathlib import Path

KERNELS = ("dflash_topk_partial", "dflash_topk_merge")
GEMM_KERNELS = tuple(f"dflash_{e}_mt{mt}" for e in ("gemm", "gemm2", "gemm3", "gemm_res", "swiglu") for mt in (1, 2, 3, 4)) + (
    "dflash_gemm_reduce", "dflash_gemm3_norm_mt1", "dflash_swiglu_norm_mt1", "dflash_rms_norm")
GEMM_Q4_KERNELS = tuple(f"dflash_q4{e}_mt{mt}" for e in ("gemm", "gemm2", "gemm3", "gemm_res", "swiglu") for mt in (1, 2, 3, 4))
ATTENTION_KERNELS = ("dflash_attention",)
ATTENTION_GATED_KERNELS = ("dflash_attention_gated",)
ATTENTION_GATED_D256_KERNELS = ("dflash_attention_gated_d256",)
NORM_ROPE_KERNELS = ("dflash_norm_rope", "dflash_norm_rope2", "dflash_norm_rope_v", "dflash_norm_rope2_v",
                     "dflash_norm_rope2_kv")
GDN_KERNELS = ("dflash_gdn",)


def kernels_of(name: str) -> tuple[str, ...]:
    """The entry points an object file must hold, from its name (topk_*, gemm_*, gemm_q4_*, attention_*,
    attention_gated_*, attention_gated_d256_*, norm_rope_* or gdn_*)."""
    stem = Path(name).name
    for prefix, kernels in (("gemm_q4_", GEMM_Q4_KERNELS), ("gemm_", GEMM_KERNELS),
                            ("attention_gated_d256_", ATTENTION_GATED_D256_KERNELS),
                            ("attention_gated_", ATTENTION_GATED_KERNELS), ("attention_", ATTENTION_KERNELS),
                            ("norm_rope_", NORM_ROPE_KERNELS), ("gdn_", GDN_KERNELS)):
        if stem.startswith(prefix):
            return kernels
    return KERNELS
EM_AMDGPU, EM_X86_64, EM_AARCH64 = 224, 62, 183
NT_AMDGPU_METADATA = 32
# EF_AMDGPU_MACH (e_flags & 0xff) per chip, from LLVM's AMDGPUUsage table.
AMDGPU_MACH = {"gfx1030": 0x036, "gfx1100": 0x041, "gfx1151": 0x04a, "gfx1201": 0x04e}


def _msgpack(b: bytes, i: int = 0):
    """Decodes one MessagePack value at offset i; returns (value, next offset)."""
    t = b[i]
    if t <= 0x7F:
        return t, i + 1
    if t >= 0xE0:
        return t - 256, i + 1
    if 0x80 <= t <= 0x8F or t in (0xDE, 0xDF):
        n, i = (t & 0x0F, i + 1) if t <= 0x8F else ((struct.unpack_from(">H", b, i + 1)[0], i + 3) if t == 0xDE
                                                     else (struct.unpack_from(">I", b, i + 1)[0], i + 5))
        out = {}
        for _ in range(n):
            k, i = _msgpack(b, i)
            out[k], i = _msgpack(b, i)
        return out, i
    if 0x90 <= t <= 0x9F or t in (0xDC, 0xDD):
        n, i = (t & 0x0F, i + 1) if t <= 0x9F else ((struct.unpack_from(">H", b, i + 1)[0], i + 3) if t == 0xDC
                                                     else (struct.unpack_from(">I", b, i + 1)[0], i + 5))
        out = []
        for _ in range(n):
            v, i = _msgpack(b, i)
            out.append(v)
        return out, i
    if 0xA0 <= t <= 0xBF or t in (0xD9, 0xDA, 0xDB):
        n, i = (t & 0x1F, i + 1) if t <= 0xBF else {0xD9: (b[i + 1], i + 2),
                                                    0xDA: (struct.unpack_from(">H", b, i + 1)[0], i + 3),
                                                    0xDB: (struct.unpack_from(">I", b, i + 1)[0], i + 5)}[t]
        return b[i:i + n].decode(), i + n
    fixed = {0xC0: (None, 1), 0xC2: (False, 1), 0xC3: (True, 1)}
    if t in fixed:
        return fixed[t][0], i + fixed[t][1]
    fmt = {0xCC: ">B", 0xCD: ">H", 0xCE: ">I", 0xCF: ">Q", 0xD0: ">b", 0xD1: ">h", 0xD2: ">i", 0xD3: ">q",
           0xCA: ">f", 0xCB: ">d"}[t]
    return struct.unpack_from(fmt, b, i + 1)[0], i + 1 + struct.calcsize(fmt)


class Elf:
    """The few parts of an ELF-64 little-endian file we check: machine, flags, symbols, notes."""

    def __init__(self, data: bytes):
        if data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
            raise ValueError("not a little-endian ELF-64 file")
        self.data = data
        (self.machine,) = struct.unpack_from("<H", data, 18)
        (self.flags,) = struct.unpack_from("<I", data, 48)
        shoff, = struct.unpack_from("<Q", data, 40)
        shentsize, shnum, shstrndx = struct.unpack_from("<HHH", data, 58)
        self.sections = [struct.unpack_from("<IIQQQQIIQQ", data, shoff + k * shentsize) for k in range(shnum)]
        names = self.sections[shstrndx]
        self.section_names = [self._str(names[4] + s[0]) for s in self.sections]

    def _str(self, off: int) -> str:
        return self.data[off:self.data.index(b"\0", off)].decode()

    def symbols(self) -> dict[str, int]:
        """Symbol name -> section index (0 for undefined), over every SHT_SYMTAB."""
        out = {}
        for s in self.sections:
            if s[1] != 2:
                continue
            strtab = self.sections[s[6]]
            for off in range(s[4], s[4] + s[5], 24):
                name, _, _, shndx = struct.unpack_from("<IBBH", self.data, off)
                if name:
                    out[self._str(strtab[4] + name)] = shndx
        return out

    def notes(self) -> list[tuple[str, int, bytes]]:
        """(owner, type, descriptor) of every note in SHT_NOTE sections."""
        out = []
        for s in self.sections:
            if s[1] != 7:
                continue
            i, end = s[4], s[4] + s[5]
            while i < end:
                namesz, descsz, ntype = struct.unpack_from("<III", self.data, i)
                name = self.data[i + 12:i + 12 + namesz].rstrip(b"\0").decode()
                d0 = i + 12 + (namesz + 3) // 4 * 4
                out.append((name, ntype, self.data[d0:d0 + descsz]))
                i = d0 + (descsz + 3) // 4 * 4
        return out


def amdgpu_kernels(path: Path) -> dict[str, dict]:
    """Kernel name -> its code-object metadata map (keys like '.vgpr_spill_count')."""
    elf = Elf(path.read_bytes())
    for owner, ntype, desc in elf.notes():
        if owner == "AMDGPU" and ntype == NT_AMDGPU_METADATA:
            meta, _ = _msgpack(desc)
            return {k[".name"]: k for k in meta["amdhsa.kernels"]}
    raise ValueError(f"{path}: no AMDGPU metadata note")


def inspect_object(path: Path, arch: str, kernels: tuple[str, ...] = KERNELS) -> list[str]:
    """Problems found in ARCH's object at PATH (empty when it is sound).

    kernels: the entry points it must hold (default the top-K pair; GEMM_KERNELS for gemm_*).
    gfx*: an AMDGPU ELF for that chip holding the kernels with no scratch and no spills.
    sm_*: PTX for that target at an ISA version CUDA 12 drivers load (<= 8.0), both entries,
    no local-memory declarations. host: an ELF with both workgroup functions and no undefined symbols.
    """
    problems = []
    if arch.startswith("gfx"):
        elf = Elf(path.read_bytes())
        if elf.machine != EM_AMDGPU or (elf.flags & 0xFF) != AMDGPU_MACH[arch]:
            problems.append(f"machine {elf.machine}, flags {elf.flags:#x}: not a {arch} code object")
        metas = amdgpu_kernels(path)
        for k in kernels:
            meta = metas.get(k)
            if meta is None:
                problems.append(f"kernel {k} missing")
                continue
            for key in (".private_segment_fixed_size", ".vgpr_spill_count", ".sgpr_spill_count"):
                if meta.get(key, 0) != 0:
                    problems.append(f"{k}: {key} = {meta[key]}")
            if ".text" not in elf.section_names or f"{k}.kd" not in elf.symbols():
                problems.append(f"{k}: no ISA (.text / kernel descriptor)")
    elif arch.startswith("sm_"):
        ptx = path.read_text()
        version = re.search(r"^\.version (\d+)\.(\d+)", ptx, re.M)
        if not version or (int(version[1]), int(version[2])) > (8, 0):
            problems.append(f"PTX ISA {version[0] if version else '?'}: CUDA 12.0 drivers load up to 8.0")
        if not re.search(rf"^\.target {arch}\b", ptx, re.M):
            problems.append(f"PTX is not for .target {arch}")
        for k in kernels:
            if not re.search(rf"\.entry {k}\(", ptx):
                problems.append(f"entry {k} missing")
        if re.search(r"\.local\b", ptx):
            problems.append("PTX uses local memory")
    else:
        elf = Elf(path.read_bytes())
        syms = elf.symbols()
        for k in kernels:
            if syms.get(f"{k}_cpu", 0) == 0:
                problems.append(f"function {k}_cpu missing")
        undefined = sorted(s for s, ndx in syms.items() if ndx == 0)
        if undefined:
            problems.append(f"undefined symbols (no libc in an embedded ELF): {', '.join(undefined)}")
    return problems
