"""`make kernels`: rebuild the committed kernel objects (top-K, skinny GEMM, block attention, norm + rope, GDN step) with the pinned clang, inspect them, write the manifest.

    python -m dflash_iree.kernels.build            # rebuild kernels/objects/ and its manifest.json
    python -m dflash_iree.kernels.build --check    # rebuild into a temporary folder, compare bytes

One compiler builds every object, so one version pins them all: clang-19 (Debian 19.1.7) with
lld-19, both from `apt-get install clang-19 lld-19`. Outputs are byte-for-byte reproducible with
that version (no paths or dates inside), which is what --check relies on. Each kernel's sources are
in its folder, kernels/<kernel>/, and clang runs there (so the commands name the files alone);
which archs each kernel is built for is dflash_iree/arch.py's table.

- sm_80/86/89: PTX through clang's CUDA mode without CUDA headers or libdevice. The PTX ISA
  version is set explicitly (7.8, loaded by every CUDA 12 driver; sm_89 needs at least 7.8);
  --cuda-path points nowhere so that an installed newer CUDA cannot raise it.
- gfx1030/1100/1151/1201: HIP code objects (AMDGPU ELF, wave32) without HIP headers or device libs.
- host: freestanding ELF objects for IREE's embedded-ELF loader, x86-64-v3 (AVX2, FMA) and armv8-a.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from dflash_iree.arch import KERNELS, kernel_archs

from .isa import inspect_object, kernels_of

HERE = Path(__file__).resolve().parent
OBJECTS = HERE / "objects"
CLANG, LLD = "clang-19", "ld.lld-19"
PINNED = "19.1.7"
PTX_ISA = "7.8"
SOURCES = ("topk/topk_body.h", "topk/topk_gpu.cu", "topk/topk_cpu.c", "gemm/gemm_body.h", "gemm/gemm_gpu.cu", "gpu.h",
           "attention/attention_body.h", "attention/attention_gpu.cu", "norm_rope/norm_rope_body.h",
           "norm_rope/norm_rope_gpu.cu", "gdn/gdn_body.h", "gdn/gdn_gpu.cu")

# Embedded-ELF objects: no libc or builtins to call, no stack protector (no TLS), and the fast-math
# subset that lets clang vectorize the exp sum (reassociation), without assuming finite values
# (padding is -inf).
_CPU_FLAGS = ["-std=c17", "-O3", "-ffreestanding", "-fno-builtin", "-fno-stack-protector", "-fvisibility=hidden",
              "-fno-plt", "-fno-exceptions", "-ffunction-sections", "-fdata-sections", "-fno-math-errno",
              "-fno-trapping-math", "-fassociative-math", "-fno-signed-zeros", "-ffp-contract=fast"]


# Objects built from a kernel's GPU layer with other macros: kernel -> ((object stem, clang -D flags), ...).
VARIANTS = {"gemm": (("gemm_q4", ["-DGM_BITS=4"]),),
            "attention": (("attention_gated", ["-DAT_GATE=1"]),
                          ("attention_gated_d256", ["-DAT_GATE=1", "-DAT_DMAX=256"]))}


def targets() -> dict[str, tuple[str, str, list[str]]]:
    """Object file name -> (arch, the kernel folder clang runs in, clang arguments after the compiler name)."""
    cuda = ["-x", "cuda", "--cuda-device-only", "-nocudainc", "-nocudalib", "--cuda-path=/nonexistent", None,
            "-Xclang", "-target-feature", "-Xclang", "+ptx" + PTX_ISA.replace(".", ""), "-O3", "-S"]
    hip = ["-x", "hip", None, "--offload-device-only", "--no-gpu-bundle-output", "-fuse-cuid=none", "-nogpulib",
           "-nogpuinc", "-O3", f"--ld-path={shutil.which(LLD) or LLD}"]
    out = {}
    for kernel in KERNELS:
        # The norm + rope: no contracted multiply-adds, so that each product rounds as the eager ops'
        # do (norm_rope/norm_rope_body.h). The GEMM is on the archs with matrix instructions only.
        # The GDN step likewise (gdn/gdn_body.h: reference.py repeats its roundings in NumPy).
        tail = (["-ffp-contract=off"] if kernel in ("norm_rope", "gdn") else []) + [f"{kernel}_gpu.cu"]
        # The GEMM's 4-bit entry points are an object of their own (gemm_gpu.cu, GM_BITS), and so are
        # the attention's gated ones (attention_body.h, "Variants"), so that adding them leaves the
        # objects before them byte for byte as they were.
        for stem, defs in ((kernel, []), *VARIANTS.get(kernel, ())):
            for arch in kernel_archs(kernel, "cuda"):
                out[f"{stem}_{arch}.ptx"] = (arch, kernel, [a or f"--cuda-gpu-arch={arch}" for a in cuda] + defs + tail)
            for arch in kernel_archs(kernel, "hip"):
                out[f"{stem}_{arch}.co"] = (arch, kernel, [a or f"--offload-arch={arch}" for a in hip] + defs + tail)
    out["topk_x86_64.o"] = ("host", "topk", ["--target=x86_64-unknown-unknown-eabi-elf", "-march=x86-64-v3",
                                             *_CPU_FLAGS, "-c", "topk_cpu.c"])
    out["topk_arm_64.o"] = ("host-arm_64", "topk", ["--target=aarch64-none-elf", "-march=armv8-a", *_CPU_FLAGS,
                                                    "-c", "topk_cpu.c"])
    return out


def clang_version() -> str | None:
    """First line of `clang-19 --version`, or None when clang-19 or lld-19 is not installed."""
    if not shutil.which(CLANG) or not shutil.which(LLD):
        return None
    return subprocess.run([CLANG, "--version"], capture_output=True, text=True, check=True).stdout.splitlines()[0]


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def build(outdir: Path) -> dict:
    """Builds every object into OUTDIR, inspects each; returns the manifest. Raises RuntimeError."""
    version = clang_version()
    if version is None:
        raise RuntimeError(f"{CLANG} and {LLD} are needed: apt-get install clang-19 lld-19")
    outdir.mkdir(parents=True, exist_ok=True)
    objects = {}
    for name, (arch, folder, args) in targets().items():
        out = outdir.resolve() / name
        subprocess.run([CLANG, *args, "-o", str(out)], cwd=HERE / folder, check=True)
        problems = inspect_object(out, arch.replace("host-arm_64", "host"), kernels_of(name))
        if problems:
            raise RuntimeError(f"{name}: " + "; ".join(problems))
        shown = [a if not a.startswith("--ld-path=") else f"--ld-path={LLD}" for a in args]
        objects[name] = {"arch": arch, "sha256": sha256(out), "bytes": out.stat().st_size,
                         "command": " ".join([CLANG, *shown, "-o", name])}
    return {"compiler": version, "pinned": f"{CLANG} {PINNED}", "ptx_isa": PTX_ISA,
            "sources": {s: sha256(HERE / s) for s in SOURCES}, "objects": objects}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--check", action="store_true", help="rebuild into a temporary folder and compare with objects/")
    args = p.parse_args(argv)
    version = clang_version()
    if version is not None and PINNED not in version:
        print(f"warning: objects are pinned to {CLANG} {PINNED}, this is '{version}'", file=sys.stderr)
    if not args.check:
        manifest = build(OBJECTS)
        (OBJECTS / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
        print(f"built {len(manifest['objects'])} objects in {OBJECTS} with {manifest['compiler']}")
        return 0
    committed = json.loads((OBJECTS / "manifest.json").read_text())
    with tempfile.TemporaryDirectory() as tmp:
        fresh = build(Path(tmp))
    bad = [n for n, o in fresh["objects"].items() if committed["objects"].get(n, {}).get("sha256") != o["sha256"]
           or sha256(OBJECTS / n) != o["sha256"]]
    if bad:
        print(f"rebuilt objects differ from the committed ones: {', '.join(bad)} (run `make kernels`)")
        return 1
    print(f"{len(fresh['objects'])} objects rebuilt identically with {fresh['compiler']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
