"""Qwen3.5-27B-shaped speed on a GPU: decode, verify(16), draft, a round and a 2k-token prefill of
the hybrid target, against copy bandwidth (the DeltaNet state counted) and torch.compile of the
same module on the same weights.

    # here: the pair compiled weight-free (tests/fixtures/qwen3.5-27b, its DFlash v1 fixture, block 16)
    .venv/bin/python bench/compile_from_config.py --target tests/fixtures/qwen3.5-27b \\
        --drafter tests/fixtures/qwen3.5-27b-dflash --archs sm_80 --keep .gpu/27b-b16
    .venv/bin/python bench/pack_device.py wheels
    .venv/bin/python bench/pack_device.py artifacts 27b-b16-sm_80
    # on the GPU machine, in one call: ours, then the peer in a process of its own (ours freed)
    bash bench/on_device.sh python3 bench/speed_27b.py run --json $OUT/speed_27b.json --profile
    bash bench/on_device.sh python3 bench/speed_27b.py peer --json $OUT/speed_27b_peer.json
    # here
    .venv/bin/python bench/speed_27b.py report OUT/speed_27b.json OUT/speed_27b_peer.json

Issue 26's measurement, as bench/speed_8b.py's for the 8B: no checkpoint travels. `run` builds the
target and drafter from the artifact's recorded configs on the GPU with the modules' own random
bf16 initialization (bench/draft_step.py `_modules`, non-finite values zeroed), copies them to host
memory, frees them, and binds those tensors into the compiled module, so one copy of the 54 GB
target is on the device at a time (an 80 GB H100 holds it). The steps are bench/speed_8b.py
`_iree_steps`' (after a 512-token prefill), plus a 2048-token prefill. With --profile, every
kernel's CUPTI time, summed per kind (`KINDS`). `peer` builds the same weights again (the same seed
and initialization) and times our `Qwen35` module's decode step in PyTorch eager and under
torch.compile, 64 steps chained on the device (bench/speed_8b.py `_torch_decode`).

Bytes a decode step moves: every target weight but the embedding table (one row is read), the
DeltaNet state slot read and the next one written (float32 [48, 128, 128] a layer, and the conv
window), and the attention layers' K and V over the rows attended. A verify of B rows writes B
slots. Shares of copy bandwidth are those bytes over the step's time, against a device-to-device copy.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import speed_8b
from common import WORK, copy_bandwidth, main, write_json
from draft_step import _host_index, _modules

ARTIFACT = "27b-b16-sm_80"
PREFILL_LEN = 2048
STEPS = speed_8b.STEPS
ROWS = -(-(speed_8b.PROMPT_LEN + STEPS + 3) // 32) * 32  # the cache rows decode attends to (recorded)
# Kernel kinds of a profile, first match wins: our dispatches by name, IREE's DeltaNet state ops by
# the [Hv, dk, dv] shape their names carry (`_kind`), IREE's others by the op their name carries.
KINDS = (("copies", ("memcpy", "memset")), ("GDN step", ("dflash_gdn",)),
         ("linears (GEMM)", ("dflash_gemm", "dflash_swiglu", "dflash_q4")), ("attention", ("attention",)),
         ("norm + rope", ("norm_rope",)), ("top-K", ("topk",)), ("IREE matmuls", ("matmul", "matvec", "mmt4d")))


def _kind(name: str, state_tag: str) -> str:
    low = name.lower()
    for kind, keys in KINDS[:2]:
        if any(k in low for k in keys):
            return kind
    if state_tag in low:
        return "DeltaNet state ops (IREE)"
    for kind, keys in KINDS[2:]:
        if any(k in low for k in keys):
            return kind
    return "other IREE dispatches"


def _split(profile: dict, state_tag: str, keep: int = 40) -> dict:
    """A step's kernel ms summed per kind, and its `top` list cut to `keep` rows."""
    kinds: dict = {}
    for k in profile["top"]:
        row = kinds.setdefault(_kind(k["kernel"], state_tag), {"ms": 0.0, "per_call": 0.0})
        row["ms"] += k["ms"]
        row["per_call"] += k["per_call"]
    profile["kinds"] = {k: {"ms": round(v["ms"], 4), "per_call": round(v["per_call"], 1)}
                        for k, v in sorted(kinds.items(), key=lambda kv: -kv[1]["ms"])}
    profile["top"] = profile["top"][:keep]
    return profile


def _step_bytes(target, rows: int, block: int) -> dict:
    """Bytes a decode step and a verify of `block` rows move (module docstring)."""
    cfg = target.cfg
    embed = target.body.embed_tokens.weight
    weights = sum(p.numel() * p.element_size() for p in target.parameters()) - embed.numel() * embed.element_size()
    st = target.state
    slot = (st.gdn_slots[0, 0].numel() * st.gdn_slots.element_size()
            + st.conv_slots[0, 0].numel() * st.conv_slots.element_size())
    kv = len(cfg.attention_layers) * 2 * rows * cfg.kv_dim * target.kv_cache.element_size()
    return {"weights": weights, "state_slot": slot, "kv_read": kv, "decode": weights + 2 * slot + kv,
            "verify": weights + (1 + block) * slot + kv, "state_tag": f"{cfg.linear_num_value_heads}x"
            f"{cfg.linear_key_head_dim}x{cfg.linear_value_head_dim}"}


def _run(args) -> int:
    import iree.runtime as rt  # noqa: F401  (before torch: the wheel's runtime libraries first)
    import torch

    from dflash_iree.runtime.artifacts import Artifacts, open_device

    folder = WORK / args.artifact
    arts = Artifacts.load(folder)
    out = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "artifact": args.artifact,
           "prompt_tokens": speed_8b.PROMPT_LEN, "copy": copy_bandwidth()}
    print(f"copy bandwidth {out['copy']['tb_per_s']} TB/s", flush=True)
    torch.manual_seed(0)
    target, drafter = _modules(torch, arts, "cuda", with_target=True)
    out["bytes"] = _step_bytes(target, ROWS, arts.block_size)
    keep: list = []
    indexes = {"target": _host_index(torch, target, keep)[0], "drafter": _host_index(torch, drafter, keep)[0]}
    del target, drafter
    torch.cuda.empty_cache()
    print(f"target moves {out['bytes']['decode'] / 1e9:.2f} GB a decode step", flush=True)
    r = speed_8b._iree_steps(folder, indexes, open_device(arts), ROWS, args.profile, prefill_len=args.prefill,
                             profile_top=100000)
    for prof in r.get("profile", {}).values():
        _split(prof, out["bytes"]["state_tag"])
    out["iree"] = r
    write_json(args.json, out)
    print(_table(out, None))
    return 0


def _peer(args) -> int:
    import iree.runtime as rt  # noqa: F401
    import torch

    from dflash_iree.runtime.artifacts import Artifacts

    arts = Artifacts.load(WORK / args.artifact)
    torch.manual_seed(0)
    target, drafter = _modules(torch, arts, "cuda", with_target=True)
    del drafter
    with torch.no_grad():  # the same weights as `run` bound: non-finite values zeroed as _host_index does
        for p in target.parameters():
            if p.is_floating_point():
                p.nan_to_num_(0.0, 0.0, 0.0)
    out = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "peers": []}
    for mode in args.peers:
        try:
            with torch.no_grad():
                r = speed_8b._torch_decode(torch, target, None if mode == "eager" else mode, ROWS)
        except Exception as e:  # a peer that fails is reported, not fatal
            r = {"mode": mode, "error": f"{type(e).__name__}: {str(e)[:300]}"}
        out["peers"].append(r)
        print(f"torch {r['mode']}: {r.get('step_ms')} ms a step {r.get('error', '')}", flush=True)
        write_json(args.json, out)
    return 0


def _table(r: dict, peer: dict | None) -> str:
    it, b, copy = r["iree"], r["bytes"], r["copy"]["tb_per_s"]

    def ms(k):
        return it[k]["median_ms"] if k in it else None

    def share(nbytes, t):
        return f"{nbytes / (t * 1e-3) / 1e12 / copy:.2f}"

    lines = [f"{r['device']}, copy {copy} TB/s; target weights {b['weights'] / 1e9:.2f} GB, a state slot "
             f"{b['state_slot'] / 1e6:.1f} MB; after a {r['prompt_tokens']}-token prefill", "",
             "| step | ms | GB moved | of copy bandwidth |", "|---|---|---|---|"]
    for name, key, nbytes in (("decode (a call a token)", "decode", b["decode"]),
                              ("plain decoding, per token", "decode_ahead", b["decode"]),
                              (f"verify({it['block_size']})", "verify", b["verify"]),
                              ("draft", "draft", None), ("round: draft + verify", "round", None),
                              ("round fused (verify_draft)", "round_fused", None)):
        if ms(key) is not None:
            lines.append(f"| {name} | {ms(key):.3f} | {nbytes / 1e9 if nbytes else 0:.2f} | "
                         f"{share(nbytes, ms(key)) if nbytes else ''} |")
    lines += ["", f"verify / decode {ms('verify') / ms('decode'):.2f}; draft / verify {ms('draft') / ms('verify'):.3f}"]
    if "prefill" in it:
        p = it["prefill"]
        lines.append(f"prefill of {p['tokens']} tokens: {p['median_ms']:.1f} ms, {p['tok_per_s']} tok/s")
    for step, prof in it.get("profile", {}).items():
        lines += ["", f"{step}: {prof['kernels_per_call']} kernels, {prof['busy_ms']} busy ms of {prof['wall_ms']} wall",
                  "| kind | ms | kernels |", "|---|---|---|"]
        lines += [f"| {k} | {v['ms']:.3f} | {v['per_call']} |" for k, v in prof["kinds"].items()]
    for p in (peer or {}).get("peers", []):
        if "step_ms" in p:
            lines.append(f"\ntorch {p['mode']}: {p['step_ms']:.3f} ms a decode step; ours (plain decoding) "
                         f"{p['step_ms'] / ms('decode_ahead'):.2f}x faster")
        else:
            lines.append(f"\ntorch {p['mode']}: {p['error']}")
    return "\n".join(lines)


def _report(args) -> int:
    r = json.loads(Path(args.json[0]).read_text())
    peer = json.loads(Path(args.json[1]).read_text()) if len(args.json) > 1 else None
    print(_table(r, peer))
    return 0


def _common(p) -> None:
    p.add_argument("--artifact", default=ARTIFACT, help="the artifact folder under .gpu/")
    p.add_argument("--json", required=True)


def _run_options(p) -> None:
    _common(p)
    p.add_argument("--profile", action="store_true", help="every kernel's time per step, summed per kind")
    p.add_argument("--prefill", type=int, default=PREFILL_LEN, help="tokens of the timed prefill (0: none)")


def _peer_options(p) -> None:
    _common(p)
    p.add_argument("--peers", nargs="+", default=["eager", "reduce-overhead"],
                   help="eager and torch.compile modes")


if __name__ == "__main__":
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", "/tmp/inductor")
    sys.exit(main(__doc__, {"run": (_run, _run_options), "peer": (_peer, _peer_options),
                            "report": (_report, lambda p: p.add_argument("json", nargs="+", help="run's JSON, "
                                                                         "then peer's"))}))
