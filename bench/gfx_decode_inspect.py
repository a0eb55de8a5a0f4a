"""gfx11 by inspection (issue #24): the kernel configurations that serve decode (M = 1) in a
row-invariant build at the Qwen3-8B shape, read from the committed code objects, no GPU needed.

    .venv/bin/python bench/gfx_decode_inspect.py [--archs gfx1100 gfx1151] [--json OUT.json]

Per arch and decode dispatch (a layer's q/k/v group and gate/up + SwiGLU, each with the RMSNorm
before it in its prologue, o_proj + residual, down_proj + residual, lm_head, and the block attention
over the cache at R = 4 query rows a KV head), from the objects' AMDGPU metadata (kernels/isa.py)
and the dispatch plan (kernels/gemm `gemm_plan`): VGPRs, spills, scratch, LDS; waves a SIMD can hold
(VGPRs and LDS); the workgroups the plan launches and the waves a CU then gets; the weight bytes
each wave keeps in flight, and the sum over the GPU against the bytes in flight that the memory's
bandwidth x latency product asks for (Little's law). A ratio of 1 or more says the kernel keeps
enough requests in flight to reach the memory's bandwidth, so its fraction of bandwidth is estimated
as the memory system's own (what a copy reaches), not less; below 1, as that ratio of it.

Hardware figures (assumptions, per arch, in HW): wave32; 1536 VGPRs a SIMD lane, allocated in blocks
of 24 (RDNA3's register file, 192 KiB a SIMD), 16 waves a SIMD at most, 2 SIMDs a CU, 64 KiB LDS a
CU in CU mode; bandwidth gfx1100 960 GB/s (RX 7900 XTX, GDDR6 20 Gbps x 384 bit), gfx1151 256 GB/s
(LPDDR5X-8000 x 256 bit); memory latency 700 ns (gfx1100) and 900 ns (gfx1151), from public
pointer-chase measurements of these chips: the estimate is only as good as these figures.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HW = {
    "gfx1100": {"cus": 96, "gb_s": 960, "latency_ns": 700},
    "gfx1151": {"cus": 40, "gb_s": 256, "latency_ns": 900},
}
VGPRS, VGPR_BLOCK, MAX_WAVES, SIMDS, LDS = 1536, 24, 16, 2, 64 * 1024
# Qwen3-8B decode: (name, weights' rows, K, kernel entry point, epilogue)
H, KV, I, V = 4096, 1024, 12288, 151936
DECODE = (("norm + q/k/v", (H, KV, KV), H, "dflash_gemm3_norm_mt1", None), ("o_proj + residual", (H,), H, "dflash_gemm_res_mt1", "residual"),
          ("norm + gate/up + SwiGLU", (I, I), H, "dflash_swiglu_norm_mt1", "swiglu"), ("down_proj + residual", (H,), I,
                                                                            "dflash_gemm_res_mt1", "residual"),
          ("lm_head", (V,), H, "dflash_gemm_mt1", None))
# HIP layer (kernels/gemm/gemm_gpu.cu): GM_U chunks in flight of GM_CW tiles, a tile 16 columns x 16 k bf16
GM_U, GM_CW, TILE_BYTES = 4, 2, 16 * 16 * 2


def _waves(meta: dict, threads: int) -> int:
    """Waves a SIMD holds of this kernel: the VGPR and LDS limits."""
    vgpr = math.ceil(meta[".vgpr_count"] / VGPR_BLOCK) * VGPR_BLOCK
    by_vgpr = min(MAX_WAVES, VGPRS // vgpr)
    lds = meta[".group_segment_fixed_size"]
    wg_waves = threads // 32
    by_lds = MAX_WAVES if lds == 0 else (LDS // lds) * wg_waves // SIMDS
    return min(by_vgpr, by_lds)


def inspect(arch: str) -> dict:
    from dflash_iree.kernels import isa
    from dflash_iree.kernels.gemm import gemm_plan

    hw = HW[arch]
    gemm = isa.amdgpu_kernels(ROOT / "kernels" / "objects" / f"gemm_{arch}.co")
    att = isa.amdgpu_kernels(ROOT / "kernels" / "objects" / f"attention_{arch}.co")["dflash_attention"]
    need = hw["gb_s"] * hw["latency_ns"]  # bytes in flight that bandwidth x latency asks for (GB/s x ns = B)
    rows = []
    for name, Ns, K, entry, epi in DECODE:
        meta = gemm[entry]
        plan = gemm_plan(Ns if len(Ns) > 1 else Ns[0], K, arch, paired=epi == "swiglu")
        wgs = plan.grid_x * plan.splits
        waves_cap = _waves(meta, plan.threads) * SIMDS  # a CU
        waves_cu = min(waves_cap, math.ceil(wgs / hw["cus"]) * plan.threads // 32)
        per_wave = GM_U * GM_CW * TILE_BYTES
        inflight = min(wgs * plan.threads // 32, waves_cap * hw["cus"]) * per_wave
        rows.append({"dispatch": name, "entry": entry, "N": list(Ns), "K": K, "splits": plan.splits, "workgroups": wgs,
                     "vgprs": meta[".vgpr_count"], "spills": meta[".vgpr_spill_count"] + meta[".sgpr_spill_count"],
                     "scratch": meta[".private_segment_fixed_size"], "lds": meta[".group_segment_fixed_size"],
                     "waves_per_simd_max": waves_cap // SIMDS, "waves_per_cu_launched": waves_cu,
                     "bytes_in_flight_per_wave": per_wave, "bytes_in_flight": inflight,
                     "in_flight_over_needed": round(inflight / need, 1)})
    # decode's attention: 8 KV heads x 1 row tile (R = 4 <= 16) x chunks of 64 keys over ~530 cached rows
    chunks = math.ceil(530 / 64)
    wgs = 8 * chunks
    waves_cap = _waves(att, 256) * SIMDS
    inflight = wgs * 64 * 128 * 2 * 2  # each workgroup stages its chunk's keys and values (64 x D bf16, each)
    rows.append({"dispatch": "attention (R = 4, 530 keys)", "entry": "dflash_attention", "workgroups": wgs,
                 "vgprs": att[".vgpr_count"], "spills": att[".vgpr_spill_count"] + att[".sgpr_spill_count"],
                 "scratch": att[".private_segment_fixed_size"], "lds": att[".group_segment_fixed_size"],
                 "waves_per_simd_max": waves_cap // SIMDS, "waves_per_cu_launched": min(waves_cap, math.ceil(wgs / hw["cus"]) * 8),
                 "bytes_in_flight": inflight, "in_flight_over_needed": round(inflight / need, 1)})
    return {"arch": arch, "hw": hw, "bytes_in_flight_needed": need, "dispatches": rows}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--archs", nargs="+", default=list(HW), choices=list(HW))
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    out = [inspect(a) for a in args.archs]
    for r in out:
        print(f"\n{r['arch']}: {r['hw']['cus']} CUs, {r['hw']['gb_s']} GB/s, {r['hw']['latency_ns']} ns: "
              f"{r['bytes_in_flight_needed'] / 1024:.0f} KiB in flight needed")
        print("| dispatch | splits | workgroups | VGPRs | spills | scratch | LDS B | waves/SIMD max | waves/CU launched "
              "| KiB in flight | in flight / needed |\n|---|---|---|---|---|---|---|---|---|---|---|")
        for d in r["dispatches"]:
            print(f"| {d['dispatch']} | {d.get('splits', '-')} | {d['workgroups']} | {d['vgprs']} | {d['spills']} | "
                  f"{d['scratch']} | {d['lds']} | {d['waves_per_simd_max']} | {d['waves_per_cu_launched']} | "
                  f"{d['bytes_in_flight'] / 1024:.0f} | {d['in_flight_over_needed']} |")
    if args.json:
        args.json.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
