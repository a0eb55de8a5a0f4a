"""`dflash-iree topk-check`: build a small module per parity case, run it on a device, score it.

Building needs the IREE compiler (the `compile` extra); running needs only the runtime and NumPy,
so a machine without the compiler runs modules built elsewhere:

    dflash-iree topk-check --arch sm_80 --build-only --modules DIR                      # here
    /tmp/site/bin/dflash-iree topk-check --device cuda --no-build --modules DIR --json out.json
        # there, after bench/on_device.sh's install of the wheels into /tmp/site

gfx targets cannot be run here: `--arch gfxNNNN --build-only` compiles every case's module and
inspects the code object (ISA present, no scratch, no spills).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import numpy as np

from .reference import CASES, CONTRACT_K, LP_TOL, make_logits, score

DEFAULT_ARCH = {"local-task": "host", "local-sync": "host", "cuda": "sm_80"}


def module_name(n: int, V: int, K: int) -> str:
    return f"topk_n{n}_V{V}_K{K}.vmfb"


def build_modules(arch: str, outdir: Path) -> list[Path]:
    """Compiles one standalone module per distinct case shape for ARCH into OUTDIR (needs iree.compiler)."""
    from dflash_iree.errors import DFlashError

    try:
        import iree.compiler as ic
    except ImportError:
        raise DFlashError("topk-check builds its modules with the IREE compiler: install the compile extra "
                          "(pip install 'dflash-iree[compile]'), or run prebuilt ones with --no-build --modules DIR") from None

    from ..isa import inspect_object
    from .dispatch import device_flags, standalone_module, topk_dispatch

    outdir.mkdir(parents=True, exist_ok=True)
    out = []
    for n, V, K in dict.fromkeys((c.n, c.V, c.K) for c in CASES):
        d = topk_dispatch(n, V, K, arch)
        problems = inspect_object(d.objects[0], arch)
        if problems:
            raise RuntimeError(f"{d.objects[0].name}: " + "; ".join(problems))
        path = outdir / module_name(n, V, K)
        try:
            ic.compile_str(standalone_module(d), output_file=str(path), extra_args=device_flags(arch) + d.flags)
        except ic.CompilerToolError as e:
            errors = [ln for ln in str(e).splitlines() if "error:" in ln]
            raise DFlashError(f"iree-compile failed for {arch} ({d.objects[0].name} itself passed inspection): "
                              + (errors[0].split("error:", 1)[1].strip() if errors else "see iree-compile output")) from None
        out.append(path)
    return out


def contract_row() -> dict:
    """K=65 must be refused by the compile-side API with an error that says why."""
    from dflash_iree.errors import DFlashError

    from .dispatch import topk_dispatch

    try:
        topk_dispatch(1, 151936, CONTRACT_K, "host")
    except DFlashError as e:
        return {"case": f"K={CONTRACT_K} contract", "refused": str(e), "pass": "outside" in str(e)}
    return {"case": f"K={CONTRACT_K} contract", "refused": None, "pass": False}


def run_cases(device: str, modules: Path, seed: int = 0, runs: int = 1) -> list[dict]:
    """Runs every case RUNS times on DEVICE from the modules in MODULES; one row per case (worst run).

    Each run draws fresh logits and passes poisoned output storage (ids -7, log-probs NaN) that
    the results are tied to, so a slot the kernel does not write shows up as a mismatch.
    """
    import iree.runtime as rt

    rng = np.random.default_rng(seed)
    config = rt.Config(device)
    rows = []
    loaded = {}
    for case in CASES:
        name = module_name(case.n, case.V, case.K)
        if name not in loaded:
            ctx = rt.SystemContext(config=config)
            ctx.add_vm_module(rt.VmModule.mmap(config.vm_instance, str(modules / name)))
            loaded[name] = ctx.modules.topk_check.topk_into
        fn = loaded[name]
        worst = None
        for _ in range(runs):
            x = make_logits(case.n, case.V, case.K, rng)
            ids0 = np.full((case.n, case.K), -7, np.int32)
            lp0 = np.full((case.n, case.K), np.nan, np.float32)
            ids, lps = fn(x, case.T, ids0, lp0)
            s = score(x, case.T, np.asarray(ids), np.asarray(lps))
            if worst is None or (s["id_mismatch"], s["max_lp_err"]) > (worst["id_mismatch"], worst["max_lp_err"]):
                worst = s
        rows.append({"case": case.label, **worst})
    return rows


def format_rows(rows: list[dict]) -> str:
    lines = [f"{'case':34s} {'id_mismatch':>11s} {'tie_swap':>8s} {'max_lp_err':>10s}  result"]
    for r in rows:
        ok = "PASS" if r["pass"] else "FAIL"
        if "refused" in r:
            lines.append(f"{r['case']:34s} refused: {r['refused'] or 'NOT REFUSED'}  {ok}")
        else:
            lines.append(f"{r['case']:34s} {r['id_mismatch']:11d} {r['tie_swap']:8d} {r['max_lp_err']:10.2e}  {ok}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Entry point shared by `dflash-iree topk-check` and `python -m ...kernels.topk.check`; exit status 1 on any failure."""
    p = argparse.ArgumentParser(prog="topk-check", description=__doc__.splitlines()[0])
    add_arguments(p)
    return run(p.parse_args(argv))


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", default="local-task", help="IREE device to run on (local-task, cuda, hip)")
    p.add_argument("--arch", help="kernel arch to build for (default: host for local-*, sm_80 for cuda)")
    p.add_argument("--modules", type=Path, help="folder for the case modules (default: a temporary folder)")
    p.add_argument("--build-only", action="store_true", help="compile and inspect only (gfx targets, or for another machine)")
    p.add_argument("--no-build", action="store_true", help="run modules already in --modules (no compiler needed)")
    p.add_argument("--runs", type=int, default=1, help="fresh-logit runs per case (the worst is reported)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, help="also write the rows as JSON here")


def run(args) -> int:
    """Runs topk-check for parsed ARGS (see add_arguments); prints the table; 0 if every row passes, else 1."""
    arch = args.arch or DEFAULT_ARCH.get(args.device.split("://")[0])
    if args.no_build and not args.modules:
        print("topk-check: --no-build runs the modules in --modules DIR; give DIR", file=sys.stderr)
        return 2
    rows = [contract_row()]
    with tempfile.TemporaryDirectory() as tmp:
        modules = args.modules or Path(tmp)
        if not args.no_build:
            if arch is None:
                print(f"topk-check: give --arch for device '{args.device}'", file=sys.stderr)
                return 2
            built = build_modules(arch, modules)
            print(f"built {len(built)} modules for {arch} (objects inspected: no scratch, no spills)")
        if not args.build_only:
            rows += run_cases(args.device, modules, args.seed, args.runs)
    print(format_rows(rows))
    if args.json:
        args.json.write_text(json.dumps({"device": args.device, "arch": arch, "lp_tol": LP_TOL, "rows": rows}, indent=1))
    return 0 if all(r["pass"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
