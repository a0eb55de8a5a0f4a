"""The skinny GEMM's grouped dispatches and epilogues on one CUDA GPU (bench/gemm_bench.py
`--groups`): parity against float32 sums and the row-independence bits of every weight of a group,
and each epilogue against the plain dispatch of the same weights.

    python bench/gemm_bench.py prepare --groups --out .gpu/groups      # here
    bash bench/on_device.sh python3 bench/gemm_bench.py run --groups --modules .gpu/groups --json g.json

Groups (several weights of one x, as export/splice.py groups them): q+k+v and gate+up at M = 1, 8,
16. Epilogues (kernels/gemm/gemm_body.h): the residual add (down_proj, and a 12288-row weight for the
unsplit path) and silu(gate) * up (the 8B MLP's, unsplit, and a small pair that takes k splits),
at M = 1, 16, 33.
"""

from __future__ import annotations

import json
from pathlib import Path

from common import write_json
from gemm_bench import from_iree, parity, to_iree, ulps

GROUPS = [((4096, 1024, 1024), 4096), ((12288, 12288), 4096)]
GROUP_MS = [1, 8, 16]
EPILOGUES = [("residual", 4096, 12288), ("residual", 12288, 4096), ("swiglu", (12288, 12288), 4096),
             ("swiglu", (1024, 1024), 4096)]
EPILOGUE_MS = [1, 16, 33]


def prepare_groups(out: Path, arch: str) -> None:
    """One module per grouped shape and M: `gemm(x, w0, ..) -> (y0, ..)` (kernels/gemm/dispatch.py
    standalone_module), listed in out/groups.json."""
    import iree.compiler as ic

    from dflash_iree.kernels.gemm import gemm_dispatch, standalone_module
    from dflash_iree.kernels.topk import device_flags

    out.mkdir(parents=True, exist_ok=True)
    meta = {"arch": arch, "groups": []}
    for Ns, K in GROUPS:
        for M in GROUP_MS:
            d = gemm_dispatch(M, Ns, K, arch, name="dg")
            name = f"grp_{M}x{'_'.join(map(str, Ns))}x{K}.vmfb"
            ic.compile_str(standalone_module(d), output_file=str(out / name), extra_args=device_flags(arch) + d.flags)
            meta["groups"].append({"file": name, "M": M, "Ns": list(Ns), "K": K, "splits": d.plan.splits,
                                   "grid_x": d.plan.grid_x, "col_blocks": d.plan.col_blocks})
            print(f"{name}: plan splits {d.plan.splits}, grid_x {d.plan.grid_x} of {d.plan.col_blocks} blocks", flush=True)
    meta["epilogues"] = []
    for kind, N, K in EPILOGUES:
        for M in EPILOGUE_MS:
            files = []
            for epi in (kind, None):  # the epilogue, and the plain dispatch of the same weights
                d = gemm_dispatch(M, N, K, arch, name="dg", epilogue=epi)
                files.append(f"{epi or 'plain'}_{M}x{'_'.join(map(str, d.Ns))}x{K}.vmfb")
                ic.compile_str(standalone_module(d), output_file=str(out / files[-1]),
                               extra_args=device_flags(arch) + d.flags)
            meta["epilogues"].append({"kind": kind, "file": files[0], "plain": files[1], "M": M,
                                      "Ns": list(d.Ns), "K": K, "splits": d.plan.splits})
            print(f"{files[0]}: plan splits {d.plan.splits}", flush=True)
    (out / "groups.json").write_text(json.dumps(meta, indent=1))


def run_groups(modules: Path, out_json: Path | None) -> dict:
    """The grouped modules of `prepare --groups` on the GPU: each y_g against float32 sums rounded to
    bf16 (`parity`), and one probe row of x placed at rows 0 (M=1), 5 (M=8) and 5, 11 (M=16) giving
    bit-identical outputs for every weight, as the numerics contract requires (gemm_body.h)."""
    import iree.runtime as rt
    import torch

    torch.backends.cuda.matmul.allow_tf32 = False
    meta = json.loads((modules / "groups.json").read_text())
    config = rt.Config("cuda")
    gen = torch.Generator(device="cuda").manual_seed(1)
    rec = {"arch": meta["arch"], "groups": []}

    bits: dict[tuple, list] = {}
    for g in meta["groups"]:
        Ns, K, M = tuple(g["Ns"]), g["K"], g["M"]
        gen.manual_seed(2)  # the same weights and probe row for every M of a group
        ws = [torch.randn(n, K, generator=gen, device="cuda").to(torch.bfloat16) for n in Ns]
        probe = torch.randn(K, generator=gen, device="cuda").to(torch.bfloat16)
        x = torch.randn(M, K, generator=gen, device="cuda").to(torch.bfloat16)
        pos = [0] if M == 1 else [5] if M <= 8 else [5, 11]
        for p in pos:
            x[p] = probe
        ctx = rt.SystemContext(config=config)
        ctx.add_vm_module(rt.VmModule.mmap(config.vm_instance, str(modules / g["file"])))
        ys = ctx.modules.gemm_check.gemm(to_iree(config.device, x), *[to_iree(config.device, w) for w in ws])
        ys = ys if isinstance(ys, (list, tuple)) else [ys]
        row = {**{k: g[k] for k in ("M", "Ns", "K", "splits", "grid_x")}, "weights": []}
        for i, (w, y) in enumerate(zip(ws, ys)):
            yt = from_iree(y)
            ref = (x.float() @ w.float().t()).to(torch.bfloat16)
            row["weights"].append({"N": Ns[i], **parity(yt, ref, x.float().abs() @ w.float().abs().t())})
            for p in pos:
                bits.setdefault((Ns, K, i), []).append(yt[p].cpu().view(torch.int16).numpy().tobytes())
        rec["groups"].append(row)
        print(f"group {M:2d}x{Ns}x{K} S={g['splits']} GX={g['grid_x']}: " + ", ".join(
            f"N={w['N']} max ulp {w['max_ulp']} bad {w['bad']}" for w in row["weights"]), flush=True)
        del ctx
    rec["row_check"] = [{"Ns": list(Ns), "K": K, "weight": i, "placements": len(b), "identical": len(set(b)) == 1}
                        for (Ns, K, i), b in bits.items()]
    rec["epilogues"] = [_check_epilogue(modules, e, config, gen) for e in meta.get("epilogues", [])]
    rec["all_pass"] = (all(w["bad"] == 0 for r in rec["groups"] for w in r["weights"])
                       and all(r["identical"] for r in rec["row_check"]) and all(e["pass"] for e in rec["epilogues"]))
    print(f"grouped dispatches: {'all pass' if rec['all_pass'] else 'FAIL'} "
          f"(parity and row bits over {sum(r['placements'] for r in rec['row_check'])} placements)", flush=True)
    if out_json:
        write_json(out_json, rec)
    return rec


def _check_epilogue(modules: Path, e: dict, config, gen) -> dict:
    """One epilogue module against the plain dispatch of the same weights, on the GPU. residual: bit
    equality with bf16(r + y) of the plain y; swiglu: against bf16(bf16(silu(g)) * u) of the plain
    g, u, torch's float32 silu: the kernel's exp2 may move a product across a bf16 rounding boundary,
    so up to 1 ulp passes (the count of such outputs is reported)."""
    import iree.runtime as rt
    import torch

    Ns, K, M = tuple(e["Ns"]), e["K"], e["M"]
    gen.manual_seed(3)
    ws = [torch.randn(n, K, generator=gen, device="cuda").to(torch.bfloat16) for n in Ns]
    x = torch.randn(M, K, generator=gen, device="cuda").to(torch.bfloat16)
    dev = config.device

    def call(file, *args):
        ctx = rt.SystemContext(config=config)
        ctx.add_vm_module(rt.VmModule.mmap(config.vm_instance, str(modules / file)))
        ys = ctx.modules.gemm_check.gemm(*[to_iree(dev, a) for a in args])
        return [from_iree(y) for y in (ys if isinstance(ys, (list, tuple)) else [ys])]

    plain = call(e["plain"], x, *ws)
    if e["kind"] == "residual":
        r = torch.randn(M, Ns[0], generator=gen, device="cuda").to(torch.bfloat16) * 4
        y = call(e["file"], x, ws[0], r)[0]
        ref = (r.float() + plain[0].float()).to(torch.bfloat16)
    else:
        y = call(e["file"], x, *ws)[0]
        ref = (torch.nn.functional.silu(plain[0].float()).to(torch.bfloat16).float() * plain[1].float()).to(torch.bfloat16)
    ul = ulps(y, ref)
    out = {k: e[k] for k in ("kind", "M", "Ns", "K", "splits")}
    out.update(n=int(ul.numel()), differ=int((ul > 0).sum()), max_ulp=int(ul.max()))
    out["pass"] = out["max_ulp"] == 0 if e["kind"] == "residual" else out["max_ulp"] <= 1
    print(f"epilogue {e['kind']} {M:2d}x{Ns}x{K} S={e['splits']}: {out['differ']} of {out['n']} differ, "
          f"max {out['max_ulp']} ulp: {'pass' if out['pass'] else 'FAIL'}", flush=True)
    return out
