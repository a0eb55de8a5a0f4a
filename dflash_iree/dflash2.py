"""DFlash2 drafters: the config fields and tensors they add to a DFlash (v1) drafter, and their refusals.

Torch-free, shared by the compiler front end (config.py reads a drafter's config.json through
`read_dflash2`) and the runtime (which checks the selector's tensors before binding them).

A DFlash2 drafter (z-lab/dflash `dflash/model.py`, `DFlash2DraftModel`; vLLM
`model_executor/models/qwen3_dflash2.py`) is a v1 drafter plus, in every layer, two dynamic causal
convolutions (`layers.i.attention_conv`, `layers.i.mlp_conv`) and, after the last layer, a
candidate selector (`candidate_selector.*`) that walks the drafter's top `selector_top_k` candidates
at each slot with two [V, r] codebooks. It is marked by `architectures: ["DFlash2DraftModel"]` or by
any of the four `dflash_config` keys below, all four of which it must then have.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from .errors import DFlashError

ARCHITECTURE = "DFlash2DraftModel"
KEYS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")
SELECTOR = "candidate_selector"
CODEBOOKS = (f"{SELECTOR}.predecessor_codebook", f"{SELECTOR}.successor_codebook")
HIDDEN_PROJECTION = f"{SELECTOR}.hidden_projection.weight"


@dataclass(frozen=True)
class DFlash2Shape:
    """The fields DFlash2 adds (`dflash_config`), as integers.

    conv_kernel_size: k, taps of each convolution (row i reads rows i-k+1..i of the block).
    conv_group_size: channels that share one dynamic tap (H / group_size groups).
    selector_rank: r, the width of the codebooks and of the selector's hidden projection.
    selector_top_k: candidates per drafted slot (16 in the published drafters).
    """

    conv_kernel_size: int
    conv_group_size: int
    selector_rank: int
    selector_top_k: int


def is_dflash2(raw: dict) -> bool:
    """Whether a drafter config.json (`raw`) describes a DFlash2 drafter."""
    dcfg = raw.get("dflash_config") or {}
    return ARCHITECTURE in (raw.get("architectures") or []) or any(k in dcfg or k in raw for k in KEYS)


def read_dflash2(raw: dict, path: Path, hidden_size: int, vocab_size: int, block_size: int,
                 max_top_k: int) -> DFlash2Shape:
    """The DFlash2 fields of a drafter config, checked.

    Args:
        raw: the drafter's config.json; the fields are read from `dflash_config`, or the top level.
        path: the config.json, for the messages.
        hidden_size, vocab_size, block_size: the drafter's.
        max_top_k: the largest K of the draft top-K dispatch (kernels/topk `MAX_K`), which takes the
            selector's top-k.

    Raises:
        DFlashError: one line each for a missing or non-integer field, a group size that does not
            divide hidden_size, a kernel size outside 1..block_size, or selector_top_k above the
            top-K dispatch's limit (or the vocabulary).
    """
    dcfg = raw.get("dflash_config") or {}
    values = {}
    for key in KEYS:
        value = dcfg.get(key, raw.get(key))
        if value is None:
            raise DFlashError(f"{path}: dflash_config.{key} is missing; a DFlash2 drafter ({ARCHITECTURE}) needs "
                              f"all of {', '.join(KEYS)}")
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise DFlashError(f"{path}: dflash_config.{key} is {value!r}; it must be a positive integer")
        values[key] = value
    shape = DFlash2Shape(**values)
    if hidden_size % shape.conv_group_size:
        raise DFlashError(f"{path}: dflash_config.conv_group_size {shape.conv_group_size} does not divide "
                          f"hidden_size {hidden_size}; the convolution's groups must tile the hidden channels")
    if shape.conv_kernel_size > block_size:
        raise DFlashError(f"{path}: dflash_config.conv_kernel_size {shape.conv_kernel_size} is larger than "
                          f"block_size {block_size}; taps past the block start are always zero")
    limit = min(max_top_k, vocab_size)
    if shape.selector_top_k > limit:
        raise DFlashError(f"{path}: dflash_config.selector_top_k {shape.selector_top_k} is above {limit}, the "
                          f"most candidates the draft top-K dispatch (kernels/topk/) returns; use a drafter with "
                          f"selector_top_k <= {limit}")
    return shape


def expected_tensors(shape: DFlash2Shape, hidden_size: int, vocab_size: int, num_layers: int) -> dict:
    """Key -> shape of every tensor DFlash2 adds to a v1 drafter's (the published key set)."""
    k, H, r = shape.conv_kernel_size, hidden_size, shape.selector_rank
    out = {}
    for i in range(num_layers):
        for conv in ("attention_conv", "mlp_conv"):
            out[f"layers.{i}.{conv}.base_kernel"] = (2, k, H)
            out[f"layers.{i}.{conv}.kernel_projection.weight"] = (2 * k * (H // shape.conv_group_size), H)
    out[HIDDEN_PROJECTION] = (r, H)
    for key in CODEBOOKS:
        out[key] = (vocab_size, r)
    return out


def check_selector_tensors(folder, index: dict, shape: DFlash2Shape, hidden_size: int, vocab_size: int) -> None:
    """Refuse, in one line, a DFlash2 checkpoint whose candidate selector is missing or does not fit.

    Args:
        folder: the drafter checkpoint folder (for the message).
        index: key -> an entry with `.shape` (dflash_iree.checkpoint `index_checkpoint`).
        shape: the drafter's DFlash2 fields; hidden_size: H; vocab_size: the target's V.

    Raises:
        DFlashError: a selector tensor that is missing (a codebook saved as `...codebook.weight` is
            named so), a codebook whose V differs from the target's vocabulary, or one of another rank.
    """
    r = shape.selector_rank
    for key in (HIDDEN_PROJECTION, *CODEBOOKS):
        info = index.get(key)
        if info is None:
            other = f" (found {key}.weight: save the codebooks without the .weight suffix, as the published " \
                    "DFlash2 checkpoints do)" if f"{key}.weight" in index else ""
            raise DFlashError(f"drafter {folder}: tensor {key} is missing{other}; a DFlash2 drafter needs the "
                              "candidate selector's three tensors")
        got = tuple(info.shape)
        if key in CODEBOOKS and (len(got) != 2 or got[0] != vocab_size):
            raise DFlashError(f"drafter {folder}: {key} has shape {list(got)}, {got[0] if got else '?'} rows, but "
                              f"the target's vocabulary has {vocab_size} tokens; use the DFlash2 drafter trained "
                              "for this target")
        want = (r, hidden_size) if key == HIDDEN_PROJECTION else (vocab_size, r)
        if got != want:
            raise DFlashError(f"drafter {folder}: {key} has shape {list(got)}, but config.json's selector_rank "
                              f"{r} and hidden_size {hidden_size} give {list(want)}")
