"""gfx11 by inspection (issue #26): the hybrid kernels at the Qwen3.5-27B and -9B shapes, read from
the committed code objects, no GPU needed.

    .venv/bin/python bench/gfx_hybrid_inspect.py [--archs gfx1100 gfx1151] [--json OUT.json]

Per arch, shape and dispatch (the Gated DeltaNet step at T = 1 (decode) and T = 16 (verify), the
gated attention over a 4096-row cache at decode's and verify(16)'s query rows a KV head, the
zero-centred q/k norm + partial rope): VGPRs, spills, scratch, LDS, waves a SIMD can hold; the
workgroups the dispatch launches and the bytes they keep in flight against the memory's bandwidth x
latency product, as bench/gfx_decode_inspect.py does for decode's GEMMs (its hardware figures, HW);
the bytes the dispatch must move and the time that takes at the memory's bandwidth.

The GDN step also has a serial part: the rows of a call run one after another, each a chain of
2 R dependent float32 adds (R = 8 rows a lane), 8 cross-lane reads and 2 barriers (gdn_body.h).
`chain_us` is that chain at an assumed 8 cycles an add, 40 a cross-lane read and 100 a barrier at
the arch's clock (CLOCK_GHZ, an assumption): the
estimate is the larger of the memory time and the chain, as a fraction of the memory time: an upper
bound, not a prediction. The first form of the GDN step, which this model rated at the memory's own
fraction, measured 0.27-0.32 of copy on an H100 (experiments/2026-12-06-gdn-warp/): its latency was
more than this chain.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

from gfx_decode_inspect import HW, SIMDS, _waves

ROOT = Path(__file__).resolve().parents[1]
CLOCK_GHZ = {"gfx1100": 2.5, "gfx1151": 2.9}
# (name, GDN key heads, value heads, dk, dv, attention q heads, KV heads, head_dim, rotary dims)
SHAPES = (("Qwen3.5-27B", 16, 48, 128, 128, 24, 4, 256, 64), ("Qwen3.5-9B", 16, 32, 128, 128, 16, 4, 256, 64))
CACHE = 4096  # cached rows the attention reads (the compile's max_context)


def _meta(stem: str, arch: str, entry: str) -> dict:
    from dflash_iree.kernels import isa

    return isa.amdgpu_kernels(ROOT / "kernels" / "objects" / f"{stem}_{arch}.co")[entry]


def _row(name, entry, meta, threads, wgs, inflight, nbytes, hw, extra_us=0.0) -> dict:
    """One dispatch's figures: META its code object's metadata, THREADS a workgroup, WGS launched,
    INFLIGHT bytes in flight if every workgroup were resident (capped here at the workgroups the CUs
    hold at once), NBYTES bytes it moves, EXTRA_US a serial part (µs) the memory time cannot hide."""
    need = hw["gb_s"] * hw["latency_ns"]
    waves_cap = _waves(meta, threads) * SIMDS
    resident = min(wgs, max(1, waves_cap * 32 // threads) * hw["cus"])
    inflight = inflight * resident // wgs
    mem_us = nbytes / (hw["gb_s"] * 1e3)  # GB/s x 1e3 = bytes a µs
    ratio = inflight / need
    est_us = max(mem_us / min(ratio, 1.0), extra_us)
    return {"dispatch": name, "entry": entry, "workgroups": wgs, "vgprs": meta[".vgpr_count"],
            "spills": meta[".vgpr_spill_count"] + meta[".sgpr_spill_count"],
            "scratch": meta[".private_segment_fixed_size"], "lds": meta[".group_segment_fixed_size"],
            "waves_per_simd_max": waves_cap // SIMDS,
            "waves_per_cu_launched": min(waves_cap, math.ceil(wgs / hw["cus"]) * threads // 32),
            "bytes_in_flight": inflight, "in_flight_over_needed": round(ratio, 1), "bytes": nbytes,
            "memory_us": round(mem_us, 2), "chain_us": round(extra_us, 2) if extra_us else None,
            "estimated_fraction_of_bandwidth": round(mem_us / est_us, 2)}


def inspect(arch: str) -> dict:
    """ARCH's figures for every shape and dispatch (the table's rows), from the committed objects."""
    from dflash_iree.kernels.gdn import COLUMNS, THREADS

    hw = HW[arch]
    gdn = _meta("gdn", arch, "dflash_gdn")
    att = _meta("attention_gated_d256", arch, "dflash_attention_gated_d256")
    nr = _meta("norm_rope", arch, "dflash_norm_rope_v")
    out = []
    for shape, Hk, Hv, dk, dv, Hq, Hkv, D, rot in SHAPES:
        out_rows = []
        state = Hv * dk * dv * 4
        wgs = math.ceil(dv / COLUMNS) * Hv
        rows = -(-dk // 16)  # a lane's state rows
        for T in (1, 16):
            # a lane keeps `rows` state values of one column: the state read, then each row's write
            inflight = wgs * THREADS * rows * 4
            nbytes = state * (1 + T) + T * ((2 * Hk * dk + Hv * dv) * 2 + Hv * dv * 2)
            chain = T * (2 * rows * 8 + 8 * 40 + 2 * 100) / (CLOCK_GHZ[arch] * 1e3)
            rows_ = _row(f"GDN step, T = {T}", "dflash_gdn", gdn, THREADS, wgs, inflight, nbytes, hw, chain)
            out_rows.append(rows_)
        for T in (1, 16):
            R = T * Hq // Hkv
            chunks = math.ceil(CACHE / 64)
            a_wgs = Hkv * math.ceil(R / 16) * chunks
            inflight = a_wgs * 64 * D * 2  # a workgroup stages its chunk's keys (then values), 64 x D bf16
            nbytes = Hkv * CACHE * D * 2 * 2 * math.ceil(R / 16)  # each row tile reads the chunk's keys and values
            out_rows.append(_row(f"gated attention, R = {R}, {CACHE} keys", "dflash_attention_gated_d256", att, 256, a_wgs, inflight,
                             nbytes, hw))
        nbytes = (Hq * 2 * D + Hkv * D) * 2 * 2  # q (in q_proj's [query, gate] rows) and k, read and written
        out_rows.append(_row("q/k norm + partial rope (T = 1)", "dflash_norm_rope_v", nr, 64, Hq + Hkv,
                         (Hq + Hkv) * D * 2, nbytes, hw))
        out.append({"shape": shape, "dispatches": out_rows})
    return {"arch": arch, "hw": hw, "clock_ghz": CLOCK_GHZ[arch], "bytes_in_flight_needed": hw["gb_s"] * hw["latency_ns"],
            "shapes": out}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--archs", nargs="+", default=list(HW), choices=list(HW))
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    res = [inspect(a) for a in args.archs]
    for r in res:
        for s in r["shapes"]:
            print(f"\n{r['arch']} ({r['hw']['gb_s']} GB/s, {r['hw']['latency_ns']} ns, {r['clock_ghz']} GHz assumed), "
                  f"{s['shape']}")
            print("| dispatch | workgroups | VGPRs | spills | scratch | LDS B | waves/SIMD max | in flight / needed "
                  "| MB moved | memory µs | chain µs | upper bound, of a copy's bandwidth |\n|---|---|---|---|---|---|---|---|---|---|---|---|")
            for d in s["dispatches"]:
                print(f"| {d['dispatch']} | {d['workgroups']} | {d['vgprs']} | {d['spills']} | {d['scratch']} | {d['lds']} "
                      f"| {d['waves_per_simd_max']} | {d['in_flight_over_needed']} | {d['bytes'] / 1e6:.2f} | "
                      f"{d['memory_us']} | {d['chain_us'] or '-'} | {d['estimated_fraction_of_bandwidth']} |")
    if args.json:
        args.json.write_text(json.dumps(res, indent=1) + "\n")


if __name__ == "__main__":
    main()
