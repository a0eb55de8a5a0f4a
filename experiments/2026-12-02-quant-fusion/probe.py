"""Does IREE (llvm-cpu, the pinned 3.13) fuse a 4-bit dequantization into the matmul that reads it?

Two forms of y = x . W^T with W MLX-packed (uint32 words [N, K / 8], bf16 scales and biases per group
of 64), M rows:
- "shift": the form a torch export gives (int32 shifts and masks, then scale * q + bias): not a pure
  bit-extend, so shared/notes/next-families.md section 3 expects a separate dispatch writing W [N, K].
- "i4": the words reinterpreted as i4 [N, K] (`flow.tensor.bitcast`, no data moved: MLX's nibble order
  is i4's little-endian order), then extui + scale * q + bias in one linalg.generic feeding the matmul.
Compiles each, dumps the executables, and reports per form the dispatches and whether any dispatch
writes a tensor of W's size (N * K elements): the fusion check of issue #28.
Run: python experiments/2026-12-02-quant-fusion/probe.py [M N K]
"""

import re
import subprocess
import sys
import tempfile
from pathlib import Path

M, N, K = (int(a) for a in sys.argv[1:4]) if len(sys.argv) > 3 else (1, 512, 512)
G = 64
AGGRESSIVE = ("--iree-dispatch-creation-enable-aggressive-fusion",)


def module_grouped(dtype: str = "f32") -> str:
    """The "i4g" form (sharktank's block-scaled layout): W as i4 [N, K / G, G], the scale and bias
    broadcast by projected permutations, and the matmul a generic reducing over (group, column)."""
    g = K // G
    return (f"func.func @main(%x: tensor<{M}x{K}xf32>, %w: tensor<{N}x{K // 8}xi32>, %s: tensor<{N}x{g}xbf16>, "
            f"%b: tensor<{N}x{g}xbf16>) -> tensor<{M}x{N}xf32> {{\n"
            f"  %q = flow.tensor.bitcast %w : tensor<{N}x{K // 8}xi32> -> tensor<{N}x{g}x{G}xi4>\n"
            f"  %xg = tensor.expand_shape %x [[0], [1, 2]] output_shape [{M}, {g}, {G}] : tensor<{M}x{K}xf32> into "
            f"tensor<{M}x{g}x{G}xf32>\n"
            f"  %e = tensor.empty() : tensor<{N}x{g}x{G}x{dtype}>\n"
            "  %deq = linalg.generic {indexing_maps = [affine_map<(n, j, k) -> (n, j, k)>, affine_map<(n, j, k) -> (n, j)>, "
            "affine_map<(n, j, k) -> (n, j)>, affine_map<(n, j, k) -> (n, j, k)>], iterator_types = [\"parallel\", "
            f"\"parallel\", \"parallel\"]}} ins(%q, %s, %b : tensor<{N}x{g}x{G}xi4>, tensor<{N}x{g}xbf16>, "
            f"tensor<{N}x{g}xbf16>) outs(%e : tensor<{N}x{g}x{G}x{dtype}>) {{\n"
            f"  ^bb0(%qi: i4, %si: bf16, %bi: bf16, %o: {dtype}):\n"
            f"    %f = arith.uitofp %qi : i4 to {dtype}\n    %sf = arith.extf %si : bf16 to {dtype}\n"
            f"    %bf = arith.extf %bi : bf16 to {dtype}\n"
            f"    %m = arith.mulf %f, %sf : {dtype}\n    %r = arith.addf %m, %bf : {dtype}\n    linalg.yield %r : {dtype}\n"
            f"  }} -> tensor<{N}x{g}x{G}x{dtype}>\n"
            f"  %zero = arith.constant 0.0 : f32\n  %ye = tensor.empty() : tensor<{M}x{N}xf32>\n"
            f"  %y0 = linalg.fill ins(%zero : f32) outs(%ye : tensor<{M}x{N}xf32>) -> tensor<{M}x{N}xf32>\n"
            "  %y = linalg.generic {indexing_maps = [affine_map<(m, n, j, k) -> (m, j, k)>, affine_map<(m, n, j, k) -> (n, j, k)>, "
            "affine_map<(m, n, j, k) -> (m, n)>], iterator_types = [\"parallel\", \"parallel\", \"reduction\", \"reduction\"]} "
            f"ins(%xg, %deq : tensor<{M}x{g}x{G}xf32>, tensor<{N}x{g}x{G}x{dtype}>) outs(%y0 : tensor<{M}x{N}xf32>) {{\n"
            f"  ^bb0(%a: f32, %c: {dtype}, %acc: f32):\n"
            + (f"    %cf = arith.extf %c : {dtype} to f32\n" if dtype != "f32" else "")
            + f"    %p = arith.mulf %a, {'%cf' if dtype != 'f32' else '%c'} : f32\n    %t = arith.addf %acc, %p : f32\n"
            f"    linalg.yield %t : f32\n  }} -> tensor<{M}x{N}xf32>\n  return %y : tensor<{M}x{N}xf32>\n}}\n")


def module_extend() -> str:
    """The "ext" form: only the bit-extend (i4 -> f32) before the contraction, which reduces each group
    to a partial [M, N, K / G]; the scales and biases apply after it, on the partials:
    y[m, n] = sum_j s[n, j] * P[m, n, j] + b[n, j] * X[m, j], X[m, j] = sum_k x[m, j, k]."""
    g = K // G
    par3 = '"parallel", "parallel", "parallel"'
    return (f"func.func @main(%x: tensor<{M}x{K}xf32>, %w: tensor<{N}x{K // 8}xi32>, %s: tensor<{N}x{g}xbf16>, "
            f"%b: tensor<{N}x{g}xbf16>) -> tensor<{M}x{N}xf32> {{\n"
            f"  %q = flow.tensor.bitcast %w : tensor<{N}x{K // 8}xi32> -> tensor<{N}x{g}x{G}xi4>\n"
            f"  %xg = tensor.expand_shape %x [[0], [1, 2]] output_shape [{M}, {g}, {G}] : tensor<{M}x{K}xf32> into "
            f"tensor<{M}x{g}x{G}xf32>\n"
            f"  %e = tensor.empty() : tensor<{N}x{g}x{G}xf32>\n"
            "  %deq = linalg.generic {indexing_maps = [affine_map<(n, j, k) -> (n, j, k)>, affine_map<(n, j, k) -> (n, j, k)>], "
            f"iterator_types = [{par3}]}} ins(%q : tensor<{N}x{g}x{G}xi4>) outs(%e : tensor<{N}x{g}x{G}xf32>) {{\n"
            "  ^bb0(%qi: i4, %o: f32):\n    %f = arith.uitofp %qi : i4 to f32\n    linalg.yield %f : f32\n"
            f"  }} -> tensor<{N}x{g}x{G}xf32>\n"
            f"  %zero = arith.constant 0.0 : f32\n  %pe = tensor.empty() : tensor<{M}x{N}x{g}xf32>\n"
            f"  %p0 = linalg.fill ins(%zero : f32) outs(%pe : tensor<{M}x{N}x{g}xf32>) -> tensor<{M}x{N}x{g}xf32>\n"
            "  %p = linalg.generic {indexing_maps = [affine_map<(m, n, j, k) -> (m, j, k)>, affine_map<(m, n, j, k) -> (n, j, k)>, "
            "affine_map<(m, n, j, k) -> (m, n, j)>], iterator_types = [\"parallel\", \"parallel\", \"parallel\", \"reduction\"]} "
            f"ins(%xg, %deq : tensor<{M}x{g}x{G}xf32>, tensor<{N}x{g}x{G}xf32>) outs(%p0 : tensor<{M}x{N}x{g}xf32>) {{\n"
            "  ^bb0(%a: f32, %c: f32, %acc: f32):\n    %t0 = arith.mulf %a, %c : f32\n    %t = arith.addf %acc, %t0 : f32\n"
            f"    linalg.yield %t : f32\n  }} -> tensor<{M}x{N}x{g}xf32>\n"
            f"  %xe = tensor.empty() : tensor<{M}x{g}xf32>\n"
            f"  %x0 = linalg.fill ins(%zero : f32) outs(%xe : tensor<{M}x{g}xf32>) -> tensor<{M}x{g}xf32>\n"
            "  %xs = linalg.generic {indexing_maps = [affine_map<(m, j, k) -> (m, j, k)>, affine_map<(m, j, k) -> (m, j)>], "
            f"iterator_types = [\"parallel\", \"parallel\", \"reduction\"]}} ins(%xg : tensor<{M}x{g}x{G}xf32>) "
            f"outs(%x0 : tensor<{M}x{g}xf32>) {{\n  ^bb0(%a: f32, %acc: f32):\n    %t = arith.addf %acc, %a : f32\n"
            f"    linalg.yield %t : f32\n  }} -> tensor<{M}x{g}xf32>\n"
            f"  %ye = tensor.empty() : tensor<{M}x{N}xf32>\n"
            f"  %y0 = linalg.fill ins(%zero : f32) outs(%ye : tensor<{M}x{N}xf32>) -> tensor<{M}x{N}xf32>\n"
            "  %y = linalg.generic {indexing_maps = [affine_map<(m, n, j) -> (m, n, j)>, affine_map<(m, n, j) -> (m, j)>, "
            "affine_map<(m, n, j) -> (n, j)>, affine_map<(m, n, j) -> (n, j)>, affine_map<(m, n, j) -> (m, n)>], "
            "iterator_types = [\"parallel\", \"parallel\", \"reduction\"]} "
            f"ins(%p, %xs, %s, %b : tensor<{M}x{N}x{g}xf32>, tensor<{M}x{g}xf32>, tensor<{N}x{g}xbf16>, tensor<{N}x{g}xbf16>) "
            f"outs(%y0 : tensor<{M}x{N}xf32>) {{\n"
            "  ^bb0(%pv: f32, %xv: f32, %sv: bf16, %bv: bf16, %acc: f32):\n"
            "    %sf = arith.extf %sv : bf16 to f32\n    %bf = arith.extf %bv : bf16 to f32\n"
            "    %t0 = arith.mulf %pv, %sf : f32\n    %t1 = arith.mulf %xv, %bf : f32\n"
            "    %t2 = arith.addf %t0, %t1 : f32\n    %t = arith.addf %acc, %t2 : f32\n    linalg.yield %t : f32\n"
            f"  }} -> tensor<{M}x{N}xf32>\n  return %y : tensor<{M}x{N}xf32>\n}}\n")


def module(form: str) -> str:
    if form == "ext":
        return module_extend()
    if form == "i4g":
        return module_grouped()
    head = (f"func.func @main(%x: tensor<{M}x{K}xf32>, %w: tensor<{N}x{K // 8}xi32>, %s: tensor<{N}x{K // G}xbf16>, "
            f"%b: tensor<{N}x{K // G}xbf16>) -> tensor<{M}x{N}xf32> {{\n")
    maps = ("affine_map<(n, k) -> (n, k)>", f"affine_map<(n, k) -> (n, k floordiv {G})>")
    if form == "i4":
        body = (f"  %q = flow.tensor.bitcast %w : tensor<{N}x{K // 8}xi32> -> tensor<{N}x{K}xi4>\n"
                f"  %e = tensor.empty() : tensor<{N}x{K}xf32>\n"
                f"  %deq = linalg.generic {{indexing_maps = [{maps[0]}, {maps[1]}, {maps[1]}, {maps[0]}], "
                f"iterator_types = [\"parallel\", \"parallel\"]}} ins(%q, %s, %b : tensor<{N}x{K}xi4>, "
                f"tensor<{N}x{K // G}xbf16>, tensor<{N}x{K // G}xbf16>) outs(%e : tensor<{N}x{K}xf32>) {{\n"
                "  ^bb0(%qi: i4, %si: bf16, %bi: bf16, %o: f32):\n"
                "    %z = arith.extui %qi : i4 to i32\n    %f = arith.uitofp %z : i32 to f32\n"
                "    %sf = arith.extf %si : bf16 to f32\n    %bf = arith.extf %bi : bf16 to f32\n"
                "    %m = arith.mulf %f, %sf : f32\n    %r = arith.addf %m, %bf : f32\n    linalg.yield %r : f32\n"
                f"  }} -> tensor<{N}x{K}xf32>\n")
    else:
        body = (f"  %e = tensor.empty() : tensor<{N}x{K}xf32>\n"
                f"  %deq = linalg.generic {{indexing_maps = [affine_map<(n, k) -> (n, k floordiv 8)>, {maps[1]}, "
                f"{maps[1]}, {maps[0]}], iterator_types = [\"parallel\", \"parallel\"]}} ins(%w, %s, %b : "
                f"tensor<{N}x{K // 8}xi32>, tensor<{N}x{K // G}xbf16>, tensor<{N}x{K // G}xbf16>) "
                f"outs(%e : tensor<{N}x{K}xf32>) {{\n"
                "  ^bb0(%wi: i32, %si: bf16, %bi: bf16, %o: f32):\n"
                "    %k = linalg.index 1 : index\n    %c8 = arith.constant 8 : index\n"
                "    %j = arith.remui %k, %c8 : index\n    %j32 = arith.index_cast %j : index to i32\n"
                "    %c4 = arith.constant 4 : i32\n    %sh = arith.muli %j32, %c4 : i32\n"
                "    %v = arith.shrui %wi, %sh : i32\n    %c15 = arith.constant 15 : i32\n"
                "    %z = arith.andi %v, %c15 : i32\n    %f = arith.uitofp %z : i32 to f32\n"
                "    %sf = arith.extf %si : bf16 to f32\n    %bf = arith.extf %bi : bf16 to f32\n"
                "    %m = arith.mulf %f, %sf : f32\n    %r = arith.addf %m, %bf : f32\n    linalg.yield %r : f32\n"
                f"  }} -> tensor<{N}x{K}xf32>\n")
    tail = (f"  %zero = arith.constant 0.0 : f32\n  %ye = tensor.empty() : tensor<{M}x{N}xf32>\n"
            f"  %y0 = linalg.fill ins(%zero : f32) outs(%ye : tensor<{M}x{N}xf32>) -> tensor<{M}x{N}xf32>\n"
            f"  %y = linalg.matmul indexing_maps = [affine_map<(m, n, k) -> (m, k)>, affine_map<(m, n, k) -> (n, k)>, "
            f"affine_map<(m, n, k) -> (m, n)>] ins(%x, %deq : tensor<{M}x{K}xf32>, tensor<{N}x{K}xf32>) "
            f"outs(%y0 : tensor<{M}x{N}xf32>) -> tensor<{M}x{N}xf32>\n  return %y : tensor<{M}x{N}xf32>\n}}\n")
    return head + body + tail


def probe(form: str, work: Path, extra=()) -> dict:
    tag = form + ("_flags" if extra else "")
    src, dump = work / f"{tag}.mlir", work / f"{tag}_exe"
    src.write_text(module(form))
    tool = Path(sys.executable).parent / "iree-compile"
    subprocess.run([str(tool), str(src), "-o", str(work / f"{tag}.vmfb"), "--iree-hal-target-device=local",
                    "--iree-hal-local-target-device-backends=llvm-cpu", "--iree-llvmcpu-target-cpu=host",
                    f"--iree-hal-dump-executable-sources-to={dump}", *extra], check=True)
    files = sorted(dump.glob("*.mlir"))
    weight_sized = []
    for f in files:
        text = f.read_text()
        # a dispatch's outputs are its writeonly / readwrite bindings
        for m in re.finditer(r"!(?:iree_tensor_ext|flow)\.dispatch\.tensor<(?:writeonly|readwrite):tensor<([0-9x]+)x\w+>>", text):
            dims = [int(d) for d in m[1].split("x")]
            n = 1
            for d in dims:
                n *= d
            if n >= N * K:
                if f"{f.name}: {m[1]}" not in weight_sized:
                    weight_sized.append(f"{f.name}: {m[1]}")
    return {"dispatches": len(files), "weight_sized_writes": weight_sized}


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as work:
        for form, extra in [(f, ()) for f in ("shift", "i4", "i4g", "ext")] + [(f, AGGRESSIVE) for f in ("i4", "i4g", "ext")]:
            r = probe(form, Path(work), extra)
            print(f"M={M} N={N} K={K} {form:6s} {' '.join(extra) or 'default flags':52s} dispatches {r['dispatches']}  weight-sized writes: "
                  f"{r['weight_sized_writes'] or 'none'}")
