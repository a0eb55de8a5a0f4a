"""Session fixtures: tiny random checkpoints on disk, made once per test session."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from tiny import make_drafter, make_target


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("tiny")


@pytest.fixture(scope="session")
def target_dir(tiny_dir) -> Path:
    """Untied float32 tiny Qwen3 (4 layers, vocab 512, no eos)."""
    return make_target(tiny_dir / "target")


@pytest.fixture(scope="session")
def tied_target_dir(tiny_dir) -> Path:
    """Tied-embedding float32 tiny Qwen3."""
    return make_target(tiny_dir / "target-tied", tie=True, seed=1)


@pytest.fixture(scope="session")
def drafter_dir(tiny_dir, target_dir) -> Path:
    """Random float32 DFlash drafter for target_dir: block 8, 2 layers, taps (0, 2), mask id 511."""
    return make_drafter(tiny_dir / "drafter", target_dir)


@pytest.fixture(scope="session")
def host_artifacts(tmp_path_factory, target_dir, drafter_dir) -> Path:
    """The tiny pair compiled for the host CPU (block 8, max_context 256, float32), once per session."""
    from dflash_iree.export.compile import Progress, compile_artifacts

    out = tmp_path_factory.mktemp("compiled") / "host"
    compile_artifacts("host", target_dir, drafter_dir, out, max_context=256, log=Progress(open(os.devnull, "w")))
    return out


LONG_CONTEXT = 10240  # the soak's 10k tokens + prompt + block


@pytest.fixture(scope="session")
def long_pair(tiny_dir) -> tuple[Path, Path]:
    """(target, drafter) for long generations: the tiny shapes with the demo target's vocabulary
    (8192) and tokenizer, max_position_embeddings 16384; drafter block 4."""
    import shutil

    demo = Path(__file__).resolve().parents[1] / "models" / "demo" / "target"
    target = make_target(tiny_dir / "long-target", seed=2, vocab_size=8192, max_position_embeddings=16384)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(demo / name, target / name)
    return target, make_drafter(tiny_dir / "long-drafter", target, seed=2, block_size=4)


@pytest.fixture(scope="session")
def long_artifacts(tmp_path_factory, long_pair) -> Path:
    """long_pair compiled for the host CPU with max_context LONG_CONTEXT, once per session."""
    from dflash_iree.export.compile import Progress, compile_artifacts

    out = tmp_path_factory.mktemp("compiled-long") / "host"
    compile_artifacts("host", *long_pair, out, max_context=LONG_CONTEXT, log=Progress(open(os.devnull, "w")))
    return out


STREAMS = 4  # the multi-stream module's S


@pytest.fixture(scope="session")
def streams_artifacts(tmp_path_factory, target_dir, drafter_dir) -> Path:
    """The tiny pair compiled for the host CPU with --streams STREAMS (block 8, max_context 256), once
    per session: the batch engine's tests (tests/test_batch.py) and the stream dimension's."""
    from dflash_iree.export.compile import Progress, compile_artifacts

    out = tmp_path_factory.mktemp("compiled-streams") / "host"
    compile_artifacts("host", target_dir, drafter_dir, out, max_context=256, streams=STREAMS,
                      log=Progress(open(os.devnull, "w")))
    return out


@pytest.fixture(scope="session")
def dflash2_dir(tiny_dir, target_dir) -> Path:
    """Random float32 DFlash2 drafter for target_dir: drafter_dir's shapes plus conv k=2, group 16,
    selector rank 8, top-16 (tests/tiny.py DFLASH2)."""
    from tiny import make_dflash2_drafter

    return make_dflash2_drafter(tiny_dir / "drafter2", target_dir)


SLIDING_WINDOW = 12  # the sliding DFlash2 drafter's window: its ring is 12 + 8 slots


@pytest.fixture(scope="session")
def dflash2_sliding_dir(tiny_dir, target_dir) -> Path:
    """dflash2_dir's drafter with both layers sliding_attention, window 12 (as the Qwen3.6-27B
    DFlash2 example, whose layers all slide): a ring context cache of 12 + 8 slots."""
    from tiny import make_dflash2_drafter

    return make_dflash2_drafter(tiny_dir / "drafter2-sliding", target_dir, layer_types=["sliding_attention"] * 2,
                                sliding_window=SLIDING_WINDOW)


@pytest.fixture(scope="session")
def hybrid_pair(tiny_dir) -> tuple[Path, Path]:
    """(target, drafter): a tiny float32 Qwen3.5-family hybrid (tests/tiny_qwen35.py: 3 Gated
    DeltaNet layers, then gated attention; vocab 512) and a random DFlash drafter for it (block 8,
    taps (1, 3), mask id 511)."""
    from tiny_qwen35 import make_hybrid

    target = make_hybrid(tiny_dir / "hybrid-target", seed=4)
    return target, make_drafter(tiny_dir / "hybrid-drafter", target, block_size=8, taps=(1, 3), mask_token_id=511)


@pytest.fixture(scope="session")
def hybrid_artifacts(tmp_path_factory, hybrid_pair) -> Path:
    """hybrid_pair compiled for the host CPU (block 8, max_context 256, float32), once per session."""
    from dflash_iree.export.compile import Progress, compile_artifacts

    out = tmp_path_factory.mktemp("compiled-hybrid") / "host"
    compile_artifacts("host", *hybrid_pair, out, max_context=256, log=Progress(open(os.devnull, "w")))
    return out


@pytest.fixture(scope="session")
def quant_dirs(tiny_dir) -> dict[str, Path]:
    """4-bit float32 checkpoints of one tiny target, written by the formats' own libraries
    (tests/quant_writers.py): `mlx` (mlx-lm convert, group 64: every linear, the embedding and the
    lm_head) and `ct` (compressed-tensors pack-quantized W4A16, asymmetric, group 32, lm_head
    left float); `float` the float32 target they come from, `drafter` a float32 drafter for it."""
    from quant_writers import write_compressed_tensors, write_mlx

    target = make_target(tiny_dir / "q-float", seed=1)
    return {"float": target, "drafter": make_drafter(tiny_dir / "q-drafter", target, seed=1),
            "mlx": write_mlx(target, tiny_dir / "q-mlx"),
            "ct": write_compressed_tensors(target, tiny_dir / "q-ct", symmetric=False, dtype="float32")}


@pytest.fixture(scope="session")
def quant_artifacts(tmp_path_factory, quant_dirs) -> dict[str, Path]:
    """The `mlx` and `ct` 4-bit targets of quant_dirs, each with the float drafter, compiled for the
    host CPU (block 8, max_context 256, float32), once per session; each compile's log beside its
    folder (`compile.log`)."""
    from dflash_iree.export.compile import Progress, compile_artifacts

    out = {}
    for fmt in ("mlx", "ct"):
        out[fmt] = tmp_path_factory.mktemp(f"compiled-{fmt}") / "host"
        with open(out[fmt].parent / "compile.log", "w") as log:
            compile_artifacts("host", quant_dirs[fmt], quant_dirs["drafter"], out[fmt], max_context=256,
                              log=Progress(log))
    return out
