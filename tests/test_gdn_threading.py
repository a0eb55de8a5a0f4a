"""The GPU kernel path of a hybrid target's Gated DeltaNet layers, run eagerly on the host.

While exporting for a GPU, export/qwen35.py `Qwen35.step` hands each GDN layer's rule (a prefill
longer than the slots as blocks of up to 16 rows, each resuming from the last) to the named op `ops.gated_delta_rule` with `state.rows(start,
stream)` and the state slots threaded from layer to layer, then stores the threaded slots and
the conv windows itself (`gdn_slots.copy_`, `state.write(start, None, ...)`). Eager, that op
returns its reference operands, and on the host IREE lowers the references, so this threading
(rows for several streams and for the one-stream `stream=` form, the layer index, the final
store) otherwise runs only on a GPU, inside kernels/gdn/.

Here one script of calls (a prefill longer than B, verify blocks rolled back to different
accepted lengths per stream, decodes, a stream starting over at 0 beside the other, short
verifies, and the one-stream form of export/stream_entry_points.py) runs twice on the tiny
float32 hybrid with S = 2 streams: eager, and with the kernel path forced, the op replaced by
what the kernel computes and writes (kernels/gdn/reference.py `gdn_step` on the op's real
operands, ref_o and ref_slots ignored). Every call's greedy tokens, logits and kept state and conv-window slots
(after each call, every stream's slot rows its next call may resume from) must agree, to float32
rounding: the two rules sum in different orders. Planted controls, kept: the same path with the
threading broken (every stream's states written to stream 0's rows, the next layer's slots, the
state read one slot late, a prefill's blocks each starting from zeros) must fail that comparison.

Forcing the path: `Qwen35.step` takes it while `ops.exporting()` is true, so qwen35.py's `ops` is
swapped for a view of export/ops.py whose `exporting()` says True (qwen35.py only; loading and
every other module are untouched). The only other consumer in that
file during these calls is `gated_cache_attention`, whose named op `ops.block_attention` then
runs eagerly and returns a copy of its reference (the same values); the fused head norm + rope
branch needs attention="fused", which the loaded target does not use. Tokens are random per call:
the comparison is of the two paths on the same inputs, not of a decoding.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from dflash_iree.export import ops, qwen35
from dflash_iree.export.load import load_target
from dflash_iree.export.stream_entry_points import slot_arg, target_step_stream
from dflash_iree.kernels.gdn.reference import gdn_step

B, S, CONTEXT, V = 8, 2, 64, 512
# measured: logits (|x| < 12) differ by <= 5e-5, slots (|x| < 3) by <= 4e-6; the planted errors by > 0.1
LOGITS_ATOL, SLOTS_ATOL = 1e-3, 1e-4

# In order: ((start of stream 0, of stream 1), T) for an [S, T] call, or (stream, start, T) for the
# one-stream form. Each start is where the stream's previous call rolled back to (accepted drafts).
SCRIPT = [
    ((0, 0), 12),   # prefill longer than B: eager the chunked rule, the kernel path one block; last state only
    ((12, 12), B),  # verify from slot 0 of the prefill
    ((15, 19), 1),  # accepted 2 and 6: decode
    ((16, 20), B),
    ((24, 21), B),  # accepted 7 (all) and 0
    ((25, 25), 1),  # accepted 0 and 3
    ((0, 26), B),   # stream 0 starts a new sequence (zero state) beside stream 1
    ((5, 28), 1),   # accepted 4 and 1
    (1, 29, B),     # one-stream form, stream 1
    (0, 6, B),
    (1, 32, 1),     # accepted 2
    (0, 12, 3),     # accepted 5; a short verify
    ((15, 33), B),  # accepted 2 (all of 3); both streams again
    (0, 0, 20),     # stream 0's one-stream prefill, two blocks on the kernel path (16 + 4), then its verify
    (0, 20, B),
    ((23, 36), 1),  # accepted 2 and 2
]


class ExportingOps:
    """export/ops.py as qwen35.py sees it while exporting: `exporting()` True, the rest the module's."""

    @staticmethod
    def exporting():
        return True

    def __getattr__(self, name):
        return getattr(ops, name)


def emulate(mixed, b, a, A_log, dt_bias, rows, slots, layer, key_heads, every_row, ref_o, ref_slots):
    """What the GPU kernel returns for `ops.gated_delta_rule`: `gdn_step` on the real operands."""
    n = lambda x: x.detach().numpy()  # noqa: E731
    o, out = gdn_step(n(mixed), n(b), n(a), n(A_log), n(dt_bias), n(slots), n(rows), layer, key_heads, slots.shape[4],
                      every_row=every_row)
    return torch.from_numpy(o).to(ref_o.dtype).view(ref_o.shape), torch.from_numpy(out)


def writes_stream_0(mixed, b, a, A_log, dt_bias, rows, slots, *rest):
    """Planted: every stream's states written to stream 0's rows (read from the right ones)."""
    return emulate(mixed, b, a, A_log, dt_bias, torch.stack([rows[:, 0], rows[:, 1] % B], 1), slots, *rest)


def wrong_layer(mixed, b, a, A_log, dt_bias, rows, slots, layer, *rest):
    """Planted: layer l reads and writes the slots of layer (l + 1) % n_gdn."""
    return emulate(mixed, b, a, A_log, dt_bias, rows, slots, (layer + 1) % slots.shape[2], *rest)


def reads_one_late(mixed, b, a, A_log, dt_bias, rows, slots, *rest):
    """Planted: the state before row 0 read from the next slot of the stream (rows[s, 0] + 1, wrapped)."""
    at, base = rows[:, 0], rows[:, 1]
    at = torch.where(at < 0, at, base + (at - base + 1) % B)
    return emulate(mixed, b, a, A_log, dt_bias, torch.stack([at, base], 1), slots, *rest)


def prefill_blocks_restart(mixed, b, a, A_log, dt_bias, rows, slots, layer, key_heads, every_row, *rest):
    """Planted: a prefill's blocks after the first start from zeros, not from the block before."""
    if not every_row and bool((rows[:, 0] == rows[:, 1]).all()):
        rows = torch.stack([torch.full_like(rows[:, 0], -1), rows[:, 1]], 1)
    return emulate(mixed, b, a, A_log, dt_bias, rows, slots, layer, key_heads, every_row, *rest)


def run(target_dir, rule=None, prefill_form="chunked"):
    """SCRIPT on a fresh target: eager (rule None) or the kernel path with `rule` as the op.
    Returns per call (chosen, logits, every stream's kept gdn and conv slots after it) and the op's layer per call."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        target = load_target(target_dir, max_context=CONTEXT, streams=S, block_size=B)
    target.prefill_form = prefill_form
    results, op_calls = [], []
    step = target.step

    def recording_step(tokens, *args):  # both forms call target.step; keep its chosen and logits
        chosen, logits, taps = step(tokens, *args)
        results.append([chosen, logits])
        return chosen, logits, taps
    target.step = recording_step

    def counted(*args):
        op_calls.append(args[7])
        return rule(*args)

    gen = torch.Generator().manual_seed(0)
    kept = {}  # stream -> slots its last call kept: every state its next call may resume from
    with pytest.MonkeyPatch.context() as mp, torch.no_grad():
        if rule is not None:
            mp.setattr(qwen35, "ops", ExportingOps())
            mp.setattr(ops, "gated_delta_rule", counted)
        for call in SCRIPT:
            if len(call) == 2:
                (starts, T), streams = call, list(range(S))
                target(torch.randint(0, V, (S, T), generator=gen), torch.tensor(starts))
            else:
                (stream, start, T), streams = call, [call[0]]
                tokens = torch.randint(0, V, (1, T), generator=gen)
                target_step_stream(target, tokens, slot_arg(stream), torch.tensor([start]), CONTEXT, None)
            kept.update((s, T if T <= B else 1) for s in streams)
            results[-1].append(torch.cat([target.state.gdn_slots[s, :n] for s, n in sorted(kept.items())]))
            results[-1].append(torch.cat([target.state.conv_slots[s, :n] for s, n in sorted(kept.items())]))
    assert len(results) == len(SCRIPT)
    return results, op_calls


def mismatches(want, got) -> list[str]:
    """Where two runs' (chosen, logits, kept gdn and conv slots) disagree, one line per call and result."""
    out = []
    for i, (w, g) in enumerate(zip(want, got)):
        if not torch.equal(w[0], g[0]):
            out.append(f"call {i} {SCRIPT[i]}: chosen tokens differ")
        for name, x, y, atol in (("logits", w[1], g[1], LOGITS_ATOL), ("gdn slots", w[2], g[2], SLOTS_ATOL),
                                 ("conv slots", w[3], g[3], SLOTS_ATOL)):
            if not torch.allclose(x, y, atol=atol, rtol=0):
                out.append(f"call {i} {SCRIPT[i]}: {name} differ by {(x - y).abs().max().item():.3g}")
    return out


@pytest.fixture(scope="module")
def eager(hybrid_pair):
    return run(hybrid_pair[0])[0]


def test_kernel_path_threads_rows_layers_and_streams(hybrid_pair, eager):
    got, op_calls = run(hybrid_pair[0], emulate)
    n_gdn = eager[0][2].shape[1]  # kept slots: [rows, n_gdn, Hv, dk, dv]
    # the kernel path ran: per call, each layer in order, a prefill's blocks of a layer one after another
    assert op_calls == [l for c in SCRIPT for l in range(n_gdn) for _ in range(-(-c[-1] // qwen35.PREFILL_BLOCK))]
    assert mismatches(eager, got) == []


@pytest.mark.parametrize("broken", [writes_stream_0, wrong_layer, reads_one_late, prefill_blocks_restart],
                         ids=lambda f: f.__name__)
def test_planted_threading_errors_are_caught(hybrid_pair, eager, broken):
    got, _ = run(hybrid_pair[0], broken)
    assert mismatches(eager, got) != []


def test_kernel_path_with_a_per_token_prefill(hybrid_pair):
    """`prefill_form="per_token"` (the eager prefill token by token, every row's state at hand): the
    kernel path's last-layer reference keeps a prefill's last state only, as the eager write does."""
    want, _ = run(hybrid_pair[0], prefill_form="per_token")
    got, _ = run(hybrid_pair[0], emulate, prefill_form="per_token")
    assert mismatches(want, got) == []
