"""The Qwen3 target against transformers' Qwen3ForCausalLM: logits, argmax, taps, cache use."""

from __future__ import annotations

import pytest
import torch
from transformers import Qwen3ForCausalLM

from dflash_iree.export.load import load_target

TAPS = (0, 2, 3)


def _hf(folder):
    return Qwen3ForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def _assert_close(ours: torch.Tensor, ref: torch.Tensor):
    # float32 rounding: different summation order, scaled by the logits' size
    assert (ours - ref).abs().max().item() <= 1e-4 * max(1.0, ref.abs().max().item())
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))


@pytest.fixture(params=["untied", "tied"])
def folder(request, target_dir, tied_target_dir):
    return target_dir if request.param == "untied" else tied_target_dir


@torch.no_grad()
def test_logits_and_taps_match_transformers(folder):
    hf, ours = _hf(folder), load_target(folder, 128, tap_layer_ids=TAPS)
    tokens = torch.randint(0, 512, (1, 37), generator=torch.Generator().manual_seed(0))
    ref = hf(tokens, output_hidden_states=True)
    chosen, logits, taps = ours(tokens, torch.tensor([0]))
    _assert_close(logits, ref.logits)
    assert torch.equal(chosen, ref.logits.argmax(-1))
    # the output of decoder layer lid is HF's hidden_states[lid + 1]
    want = torch.cat([ref.hidden_states[lid + 1] for lid in TAPS], -1)
    assert taps.shape == (1, 37, 3 * 64)
    assert (taps - want).abs().max().item() < 1e-4


@torch.no_grad()
def test_prompt_split_over_calls_matches(folder):
    """Prefill in chunks, then single-token steps, against one full HF forward."""
    hf, ours = _hf(folder), load_target(folder, 128)
    tokens = torch.randint(0, 512, (1, 40), generator=torch.Generator().manual_seed(1))
    ref = hf(tokens).logits
    pieces, start = [], 0
    for size in (13, 7, 1, 16, 1, 1, 1):
        _, logits, _ = ours(tokens[:, start:start + size], torch.tensor([start]))
        pieces.append(logits)
        start += size
    _assert_close(torch.cat(pieces, 1), ref)


@torch.no_grad()
def test_rollback_by_length(target_dir):
    """Rows written past the committed length are invisible and get overwritten."""
    ours = load_target(target_dir, 64)
    tokens = torch.randint(0, 512, (1, 20), generator=torch.Generator().manual_seed(2))
    _, clean, _ = ours(tokens, torch.tensor([0]))
    ours(tokens[:, :10], torch.tensor([0]))
    ours(torch.randint(0, 512, (1, 8)), torch.tensor([10]))  # a rejected block at 10..17
    _, logits, _ = ours(tokens[:, 10:], torch.tensor([10]))
    assert (logits - clean[:, 10:]).abs().max().item() < 1e-4


@torch.no_grad()
def test_read_len_bounds_attention(target_dir):
    """Reading only the first start + T cache rows gives the same logits as reading all of them."""
    ours = load_target(target_dir, 256)
    tokens = torch.randint(0, 512, (1, 24), generator=torch.Generator().manual_seed(3))
    _, full, _ = ours(tokens, torch.tensor([0]))
    _, short, _ = ours(tokens, torch.tensor([0]), read_len=32)
    assert (full - short).abs().max().item() < 1e-5


@torch.no_grad()
def test_bf16_close_to_transformers(target_dir):
    hf = Qwen3ForCausalLM.from_pretrained(target_dir, dtype=torch.bfloat16).eval()
    ours = load_target(target_dir, 64, dtype="bf16")
    tokens = torch.randint(0, 512, (1, 16), generator=torch.Generator().manual_seed(4))
    ref = hf(tokens).logits.float()
    _, logits, _ = ours(tokens, torch.tensor([0]))
    assert ours.lm_head.weight.dtype == torch.bfloat16
    # bf16 has 8 bits of mantissa: compare against the logits' scale, not float32 rounding
    assert (logits - ref).abs().max().item() < 0.1 * ref.abs().max().item()


def test_write_cache_places_keys_and_values():
    """`cache_rows` + `write_cache` put each stream's k and v rows at its positions in the right layer, nothing else."""
    from dflash_iree.export.qwen3 import cache_rows, write_cache

    S, L, C, H, hd = 2, 3, 10, 2, 4
    cache = torch.zeros(S, L, 2, C, H * hd)
    positions = torch.tensor([[1, 2], [6, 7]])
    k, v = torch.randn(S, 2, H, hd), torch.randn(S, 2, H, hd)
    write_cache(cache, cache_rows(cache, positions)[1], k, v)
    want = torch.zeros_like(cache)
    for s in range(S):
        want[s, 1, 0, positions[s]] = k[s].reshape(2, -1)
        want[s, 1, 1, positions[s]] = v[s].reshape(2, -1)
    assert torch.equal(cache, want)


def _build_dynamo_tables() -> None:
    """Have dynamo build its tables of torch functions now (each a functools.cache, torch 2.13)."""
    from torch._dynamo.variables.torch import TorchInGraphFunctionVariable, tracing_state_functions

    tracing_state_functions()
    TorchInGraphFunctionVariable._get_handlers()
    torch._dynamo.trace_rules.get_torch_obj_rule_map()


def _compiled_graph_ops(target, monkeypatch, check) -> set[str]:
    """The call targets of the graph torch.compile captures for one decode step of target, with
    `torch.compiler.is_exporting()` answering True as dynamo makes it under torch.compile in torch
    releases before pytorch/pytorch#176499 (the H200's 2.11), and the model's export check replaced by `check`."""
    from dflash_iree.export import ops

    graphs = []

    def backend(gm, inputs):
        graphs.append(gm)
        return gm.forward

    # dynamo builds its tables of torch functions (the tracing-state ones, their handlers, its map of
    # torch objects by name) once, the first time it traces. Built while the stand-in below is in
    # place, they would hold the stand-in, not the real is_exporting: the stand-in would then answer
    # the real flag (False) rather than be traced, and every later torch.export in this process would
    # refuse the real function (tests/test_splice.py run after this file). So they are built first.
    _build_dynamo_tables()
    with monkeypatch.context() as patch:
        # True while dynamo traces (torch.compile itself checks the flag first, in eager, and must see False)
        patch.setattr(torch.compiler, "is_exporting", lambda: torch.compiler.is_compiling())
        patch.setattr(ops, "exporting", check)
        torch._dynamo.reset()
        step = torch.compile(lambda tok, start: target(tok, start)[0], backend=backend, fullgraph=True)
        with torch.no_grad():
            step(torch.tensor([[11]]), torch.tensor([3]))
    torch._dynamo.reset()
    return {str(n.target) for g in graphs for n in g.graph.nodes if n.op == "call_function"}


def test_torch_compile_traces_the_eager_model_not_the_export_path(target_dir, monkeypatch):
    """bench/speed_8b.py's torch.compile peer compiles the eager model: `ops.exporting()` stays False
    under torch.compile where `torch.compiler.is_exporting()` says True (it read the flag alone until
    2026-12-06, and the H200's torch 2.11 then compiled the named ops' export path, reference copies
    included). The planted control, the check as it was, puts the named ops in the graph."""
    from dflash_iree.export import ops

    target = load_target(target_dir, 64)  # the "fused" (GPU) form, which has the named ops
    assert not any("dflash" in t for t in _compiled_graph_ops(target, monkeypatch, ops.exporting))
    planted = _compiled_graph_ops(target, monkeypatch, lambda: torch.compiler.is_exporting())
    assert any("dflash" in t for t in planted)
