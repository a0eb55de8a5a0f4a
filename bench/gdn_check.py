"""The Gated DeltaNet step dispatch (kernels/gdn/) on a GPU at the Qwen3.5-27B layer shape: bits and speed.

    python bench/gdn_check.py prepare [--arch sm_80] [--iree]    # here: one standalone module per T (and per T the last-state-only form) into .gpu/gdn/
    python bench/pack_device.py wheels && python bench/pack_device.py artifacts gdn
    # carry [".gpu/wheels", ".gpu/artifacts.zip"], then on the GPU machine:
    bash bench/on_device.sh python3 bench/gdn_check.py run --json "$OUT/gdn_check.json"
    python bench/gdn_check.py report --json <the fetched gdn_check.json>    # here

Shape: S 1, Hv 48 value heads, Hk 16 key heads, dk = dv = 128, bf16 inputs and o, a slots global
[1, 16, 2, 48, 128, 128] f32 (2 GDN layers; the kernel runs layer 1), T = 1, 8, 16 rows. For each T,
on seeded inputs and a seeded initial slots global (uploaded with `set_slots`), one call reading
slot 5 (a rollback: the state after the 6th row of the call before) and writing slots 0..T-1:
- `o_bits_equal`, `states_bits_equal`: the kernel's o and its T written states against
  kernels/gdn/reference.py (NumPy float32 in the kernel's order: exact bits expected), with the
  largest differences when not; `untouched_equal`: every other slot row and layer unchanged;
- `rows_equal_t1_chain` (T > 1): the T rows' o and states bit-equal to T calls of the T = 1 module
  chained slot to slot (row invariance: decode and verify give the same bits);
- `last_only_bits_equal`: the same call built with every_row=False (a prefill's blocks: the last
  row's state only, to slot 0) against the reference's bits, o and every slot; `last_only_us` its
  time, and `every_row_writes_us` the difference: what writing every row's state (the rollback) costs;
- speed: the kernel's device time per call (CUPTI, torch.profiler), the bytes it must move (the state
  read once, T states written, the inputs and o) over that time, and that as a fraction of this GPU's
  device-to-device copy bandwidth (bench/common.py `copy_bandwidth`).
With `prepare --iree`, also IREE's own lowering of the same step (the eager rule of export/gdn.py,
`prepare` + `recurrent_rule`, exported through iree-turbine and compiled for the arch, the state an
argument and every row's state a result): `run` times it beside the kernel (`iree_us`, the sum of
its dispatches' device time a call) over the same bytes. `prepare --objects DIR --out DIR2` builds the
modules on another folder of kernel objects (a variant of gdn_gpu.cu) into DIR2 (`run --dir DIR2`).
`run` exits 1 when any bit check fails.
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import common
from common import ROOT, main, write_json

WORK = common.WORK / "gdn"
S, HV, HK, DK, DV, SLOTS, N_GDN, LAYER, FROM = 1, 48, 16, 128, 128, 16, 2, 1, 5
ROWS = (1, 8, 16)
SLOT_SHAPE = (S, SLOTS, N_GDN, HV, DK, DV)


def _iree_rule_mlir(T: int) -> str:
    """MLIR of the eager rule at this shape for T rows: (mixed, b, a, A_log, dt_bias, state [S, Hv, dk, dv] f32)
    -> (o [S, T, Hv, dv] bf16, states [T, S, Hv, dk, dv] f32), as export/gdn.py computes it."""
    import torch
    import torch.nn.functional as F
    from iree.turbine import aot

    from dflash_iree.export.gdn import prepare as rule_inputs, recurrent_rule

    class Rule(torch.nn.Module):
        def forward(self, mixed, b, a, A_log, dt_bias, state):
            q, k, v = torch.split(mixed, [HK * DK, HK * DK, HV * DV], -1)
            q, k, v = q.reshape(S, T, HK, DK), k.reshape(S, T, HK, DK), v.reshape(S, T, HV, DV)
            g = -A_log.float().exp() * F.softplus(a.float() + dt_bias)
            o, states = recurrent_rule(*rule_inputs(q, k, v, b.sigmoid(), g), state)
            return o.transpose(1, 2).to(mixed.dtype), torch.stack(states)

    bf = torch.bfloat16
    args = (torch.zeros(S, T, 2 * HK * DK + HV * DV, dtype=bf), torch.zeros(S, T, HV, dtype=bf),
            torch.zeros(S, T, HV, dtype=bf), torch.zeros(HV, dtype=bf), torch.zeros(HV, dtype=bf),
            torch.zeros(S, HV, DK, DV))
    return str(aot.export(Rule(), args=args).mlir_module)


def prepare(arch: str, out: str | None = None, objects: str | None = None, iree: bool = False) -> None:
    """Compile one standalone module per T for ARCH into OUT (.gpu/gdn/), on the objects of OBJECTS
    (default the committed ones); with IREE, also IREE's lowering of the eager rule per T."""
    import iree.compiler as ic

    from dflash_iree.errors import DFlashError
    from dflash_iree.export.compile import compile_flags, resolve_arch
    from dflash_iree.kernels.gdn import gdn_dispatch, standalone_module

    work = Path(out) if out else WORK
    arch = resolve_arch(arch)[0]  # an alias (h200) names its arch
    flags = compile_flags(arch)
    d = gdn_dispatch(S, 1, HK, HV, DK, DV, SLOT_SHAPE, "bf16", arch)
    obj = Path(objects) / d.objects[0].name if objects else d.objects[0]
    if not obj.is_file():
        raise DFlashError(f"{obj} is missing: --objects must be a folder holding {d.objects[0].name}")
    work.mkdir(parents=True, exist_ok=True)
    for T in ROWS:
        d = gdn_dispatch(S, T, HK, HV, DK, DV, SLOT_SHAPE, "bf16", arch)
        search = [f"--iree-hal-executable-object-search-path={Path(objects).resolve()}"] if objects else d.flags
        ic.compile_str(standalone_module(d), extra_args=flags + search, output_file=str(work / f"gdn_t{T}.vmfb"))
        last = gdn_dispatch(S, T, HK, HV, DK, DV, SLOT_SHAPE, "bf16", arch, every_row=False)
        ic.compile_str(standalone_module(last), extra_args=flags + search, output_file=str(work / f"gdn_last_t{T}.vmfb"))
        if iree:
            ic.compile_str(_iree_rule_mlir(T), extra_args=flags, output_file=str(work / f"iree_t{T}.vmfb"))
    meta = {"arch": arch, "rows": ROWS, "iree": iree, "object": str(obj.relative_to(ROOT) if obj.is_relative_to(ROOT) else obj),
            "object_sha256": hashlib.sha256(obj.read_bytes()).hexdigest()}
    (work / "cases.json").write_text(json.dumps(meta) + "\n")


def _inputs(T: int, seed: int = 0):
    """mixed [S, T, conv], b, a [S, T, Hv], A_log, dt_bias [Hv] as bf16 (ml_dtypes) and the initial slots (f32)."""
    import ml_dtypes
    import numpy as np

    rng = np.random.default_rng(seed)
    conv = 2 * HK * DK + HV * DV
    x = rng.standard_normal((S, 16, conv)).astype(np.float32)
    mixed = (x / (1 + np.exp(-x)))[:, :T]  # silu, as the conv's output
    b = rng.standard_normal((S, 16, HV))[:, :T]
    a = (rng.standard_normal((S, 16, HV)) * 2)[:, :T]
    A_log = rng.uniform(-1, 1, HV)
    dt_bias = rng.standard_normal(HV)
    bf = [np.ascontiguousarray(v.astype(np.float32).astype(ml_dtypes.bfloat16)) for v in (mixed, b, a, A_log, dt_bias)]
    slots = (rng.standard_normal(SLOT_SHAPE) * 0.1).astype(np.float32)
    return bf, slots


class _Module:
    def __init__(self, rt, device, path):
        self.instance = rt.VmInstance()
        vm = rt.VmModule.mmap(self.instance, str(path))
        self.ctx = rt.VmContext(self.instance, modules=[rt.create_hal_module(self.instance, device), vm])
        self.fn = {n: rt.FunctionInvoker(self.ctx, device, vm.lookup_function(n)) for n in ("gdn", "get_slots", "set_slots")}


def _device_us(call, match=None, n: int = 50) -> float | None:
    """Mean device time (µs) a call of CALL's kernels (those whose name contains MATCH; None: all), CUPTI."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    for _ in range(5):
        call()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            call()
        torch.cuda.synchronize()
    ev = [e for e in prof.key_averages() if e.device_time_total > 0 and (match is None or match in e.key)
          and "Memcpy" not in e.key and "Memset" not in e.key]
    return sum(e.device_time_total for e in ev) / n if ev else None


def run(out_json: str, work: str | None = None) -> dict:
    import iree.runtime as rt
    import numpy as np
    import torch

    from dflash_iree.kernels.gdn.reference import gdn_step

    from dflash_iree.errors import DFlashError

    WORK_ = Path(work) if work else WORK
    if not (WORK_ / "cases.json").is_file():
        raise DFlashError(f"{WORK_ / 'cases.json'} is missing: run `bench/gdn_check.py prepare` (and carry its folder)")
    meta = json.loads((WORK_ / "cases.json").read_text())
    device = rt.get_device("cuda")
    bw = common.copy_bandwidth()
    result = {"device": torch.cuda.get_device_name(0), "arch": meta["arch"], "object": meta.get("object"),
              "object_sha256": meta.get("object_sha256"), "copy_bandwidth": bw, "cases": []}
    mods = {T: _Module(rt, device, WORK_ / f"gdn_t{T}.vmfb") for T in meta["rows"]}
    f32 = lambda v: np.asarray(v).astype(np.float32)  # noqa: E731
    for T in meta["rows"]:
        m = mods[T]
        (mixed, b, a, A_log, dt_bias), slots0 = _inputs(T)
        rows = np.array([[FROM, 0]], np.int32)
        m.fn["set_slots"](slots0)
        o = f32(m.fn["gdn"](mixed, b, a, A_log, dt_bias, rows, LAYER))
        got = np.asarray(m.fn["get_slots"]())
        want_o, want_s = gdn_step(f32(mixed), f32(b), f32(a), f32(A_log), f32(dt_bias), slots0, rows, LAYER, HK, DK, "bf16")
        written = got[0, :T, LAYER]
        row = {"T": T, "o_bits_equal": bool(np.array_equal(o.view(np.uint32), want_o.view(np.uint32))),
               "states_bits_equal": bool(np.array_equal(written.view(np.uint32), want_s[0, :T, LAYER].view(np.uint32))),
               "o_max_abs_err": float(np.abs(o - want_o).max()),
               "states_max_abs_err": float(np.abs(written - want_s[0, :T, LAYER]).max()),
               "o_max_abs": float(np.abs(want_o).max())}
        mask = np.ones(SLOT_SHAPE[:3], bool)
        mask[0, :T, LAYER] = False
        row["untouched_equal"] = bool(np.array_equal(got[mask], slots0[mask]))
        if T > 1 and 1 in mods:
            one = mods[1]
            one.fn["set_slots"](slots0)
            outs = []
            for t in range(T):
                r1 = np.array([[FROM if t == 0 else t - 1, t]], np.int32)
                outs.append(f32(one.fn["gdn"](*(np.ascontiguousarray(v[:, t:t + 1]) for v in (mixed, b, a)), A_log,
                                              dt_bias, r1, LAYER)))
            chain = np.asarray(one.fn["get_slots"]())
            row["rows_equal_t1_chain"] = bool(np.array_equal(np.concatenate(outs, 1).view(np.uint32), o.view(np.uint32))
                                              and np.array_equal(chain[0, :T, LAYER].view(np.uint32),
                                                                 written.view(np.uint32)))
        # speed: inputs on the device, the same call repeated (it rewrites the same slots)
        args = [rt.asdevicearray(device, v) for v in (mixed, b, a, A_log, dt_bias, rows)]
        kernel_us = _device_us(lambda: m.fn["gdn"](*args, LAYER), "dflash_gdn")
        state = HV * DK * DV * 4
        nbytes = state * (1 + T) + T * (2 * HK * DK + HV * DV) * 2 + 2 * T * HV * 2 + T * HV * DV * 2
        row.update({"kernel_us": round(kernel_us, 2) if kernel_us else None, "bytes": nbytes,
                    "tb_per_s": round(nbytes / (kernel_us * 1e-6) / 1e12, 3) if kernel_us else None})
        if kernel_us:
            row["fraction_of_copy_bandwidth"] = round(row["tb_per_s"] / bw["tb_per_s"], 3)
        last_path = WORK_ / f"gdn_last_t{T}.vmfb"
        row["last_only_bits_equal"] = None  # not built (a folder prepared before the last-only form): not ok
        if last_path.is_file():  # the last state only (a prefill's blocks): bits, and what every row's writes cost
            lm = _Module(rt, device, last_path)
            lm.fn["set_slots"](slots0)
            lo = f32(lm.fn["gdn"](mixed, b, a, A_log, dt_bias, rows, LAYER))
            lgot = np.asarray(lm.fn["get_slots"]())
            lwant_o, lwant_s = gdn_step(f32(mixed), f32(b), f32(a), f32(A_log), f32(dt_bias), slots0, rows, LAYER, HK, DK,
                                        "bf16", every_row=False)
            row["last_only_bits_equal"] = bool(np.array_equal(lo.view(np.uint32), lwant_o.view(np.uint32))
                                               and np.array_equal(lgot.view(np.uint32), lwant_s.view(np.uint32)))
            last_us = _device_us(lambda: lm.fn["gdn"](*args, LAYER), "dflash_gdn")
            row["last_only_us"] = round(last_us, 2) if last_us else None
            if last_us and kernel_us:
                row["every_row_writes_us"] = round(kernel_us - last_us, 2)
        if meta.get("iree"):
            inst = rt.VmInstance()
            vm = rt.VmModule.mmap(inst, str(WORK_ / f"iree_t{T}.vmfb"))
            ctx = rt.VmContext(inst, modules=[rt.create_hal_module(inst, device), vm])
            fn = rt.FunctionInvoker(ctx, device, vm.lookup_function("main"))
            st0 = rt.asdevicearray(device, np.ascontiguousarray(slots0[0, FROM, LAYER][None]))
            iree_us = _device_us(lambda: fn(*args[:5], st0))
            row.update({"iree_us": round(iree_us, 2) if iree_us else None,
                        "iree_fraction_of_copy_bandwidth": round(nbytes / (iree_us * 1e-6) / 1e12 / bw["tb_per_s"], 3)
                        if iree_us else None})
        row["ok"] = row["o_bits_equal"] and row["states_bits_equal"] and row["untouched_equal"] and row.get(
            "rows_equal_t1_chain", True) and bool(row["last_only_bits_equal"])
        result["cases"].append(row)
        print(row, flush=True)
    result["ok"] = all(r["ok"] for r in result["cases"])
    write_json(out_json, result)
    return result


def report(path: str) -> None:
    from dflash_iree.errors import DFlashError

    try:
        r = json.loads(open(path).read())
        r["cases"], r["device"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise DFlashError(f"{path}: not a gdn_check.py run's JSON ({e.__class__.__name__}: {e}): pass the file `run` wrote")
    print(f"{r['device']} ({r['arch']}), copy {r['copy_bandwidth']['tb_per_s']} TB/s")
    print("| T | o bits | state bits | untouched | T=1 chain | kernel µs | MB moved | TB/s | of copy bw "
          "| last state only: bits, µs | every row's writes µs | IREE's lowering µs | of copy bw |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for c in r["cases"]:
        print(f"| {c['T']} | {c['o_bits_equal']} | {c['states_bits_equal']} | {c['untouched_equal']} | "
              f"{c.get('rows_equal_t1_chain', '-')} | {c['kernel_us']} | {c['bytes'] / 1e6:.1f} | {c['tb_per_s']} | "
              f"{c.get('fraction_of_copy_bandwidth')} | {c.get('last_only_bits_equal', '-')}, {c.get('last_only_us', '-')} | "
              f"{c.get('every_row_writes_us', '-')} | {c.get('iree_us', '-')} | "
              f"{c.get('iree_fraction_of_copy_bandwidth', '-')} |")
    print("ok" if r["ok"] else "FAILED")


if __name__ == "__main__":
    def _prepare_args(p):
        p.add_argument("--arch", default="sm_80")
        p.add_argument("--out", help="folder of the modules (default .gpu/gdn)")
        p.add_argument("--objects", help="a folder of kernel objects to build on (default the committed ones)")
        p.add_argument("--iree", action="store_true", help="also IREE's lowering of the eager rule, to time beside")

    def _run_args(p):
        p.add_argument("--json", default=str(WORK / "gdn_check.json"))
        p.add_argument("--dir", help="folder of the modules (default .gpu/gdn)")

    sys.exit(main(__doc__, {"prepare": (lambda a: prepare(a.arch, a.out, a.objects, a.iree), _prepare_args),
                            "run": (lambda a: 0 if run(a.json, a.dir)["ok"] else 1, _run_args),
                            "report": (lambda a: report(a.json), lambda p: p.add_argument("--json", required=True))}))
