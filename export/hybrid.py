"""What compiling a Qwen3.5-family hybrid target (export/qwen35.py) adds to the Qwen3 compile:
its prefill chunk, and the manifest's record of its layers and recurrent state.

The entry points are the Qwen3 ones (export/entry_points.py), with one difference: `prefill` takes
a static PREFILL_CHUNK rows, because the DeltaNet rule's loops unroll over the rows of a call
(export/gdn.py). The runtime (runtime/module.py `CompiledPair.prefill`) runs a prompt as whole
chunks through `prefill` (the chunked rule, the last state kept) and the remainder through
`verify` in blocks of B (the per-token rule, every row's state kept, so a padded last block is
rolled back by the next call's `start` like rejected drafts). Why 64 and the chunked rule:
experiments/2026-12-02-hybrid-compile/README.md. A module of several streams has the same split for
a joining request's prompt: `prefill_stream` of the chunk and `verify_stream` of B rows in its slot
(export/stream_entry_points.py); it has no `verify_rows{R}` (export/depth_entry_points.py).
"""

from __future__ import annotations

from dflash_iree.config_qwen35 import HybridConfig
from dflash_iree.manifest import DTYPES

PREFILL_CHUNK = 64  # prefill's rows: one chunk of export/gdn.py `chunked_rule` (CHUNK)


def is_hybrid(cfg) -> bool:
    """Whether a target config is a Qwen3.5-family hybrid's."""
    return isinstance(cfg, HybridConfig)


def prefill_chunk(cfg) -> int:
    """prefill's static row count: PREFILL_CHUNK for a hybrid target, 0 (dynamic) for Qwen3."""
    return PREFILL_CHUNK if is_hybrid(cfg) else 0


def _spec(shape, dtype: str) -> dict:
    n = 1
    for d in shape:
        n *= d
    return {"shape": list(shape), "dtype": dtype, "bytes": n * DTYPES[dtype].bytes}


def state_record(globals_: dict, cfg, block_size: int) -> dict:
    """The manifest's `state`: every module-initialized global with its shape, dtype and bytes
    (`globals_`: name -> {shape, dtype}), and for a hybrid target its layer pattern and recurrent
    state: the layer indices of each kind, the slots, and one step's state per stream (what each
    slot holds). Torch-free."""
    state = {"doc": "module-initialized mutable globals (zeros); not parameters, not in any checkpoint",
             "globals": {n: _spec(g["shape"], g["dtype"]) for n, g in globals_.items()}}
    if not is_hybrid(cfg):
        return state
    slots = {"gdn_state": globals_["target.state.gdn_slots"], "conv_state": globals_["target.state.conv_slots"]}
    # one step: a slot's worth, [S, n_gdn, ...] (the slot dim 1 dropped)
    step = {name: _spec(g["shape"][:1] + g["shape"][2:], g["dtype"]) for name, g in slots.items()}
    state["layer_types"] = list(cfg.layer_types)
    state["recurrent"] = {
        "doc": ("Gated DeltaNet state (f32) and conv window per GDN layer, in per-row slots: a call keeps the "
                "state after each of its rows (after the last only, for prefill), the next call's start picks "
                "the slot of the row at start - 1 (export/recurrent_state.py)"),
        "gdn_layers": list(cfg.gdn_layers),
        "attention_layers": list(cfg.attention_layers),
        "slots": block_size,
        "step": step,
        "step_bytes": sum(s["bytes"] for s in step.values()),
        "slot_bytes": sum(g["bytes"] for n, g in state["globals"].items() if n.startswith("target.state.")),
        "prefill_chunk": PREFILL_CHUNK,
        "lowering": ("decode, verify, draft and prefill (in blocks of 16 rows, the last state kept): the GDN "
                     "step kernel (kernels/gdn/) on GPU archs (`splices.gdn`); IREE's ops on the host (prefill: "
                     "the chunked rule); the conv: IREE's ops on every arch"),
    }
    return state
