"""The artifact manifest (`compiled/ARCH/manifest.json`) as one typed record, and the dtype names.

`dflash-iree compile` (export/compile.py) fills a `Manifest` and writes `to_json()`; the runtime
(runtime/artifacts.py) reads it back with `Manifest.from_json` (after dflash_iree/guard.py has read the
file whole), which refuses, naming the fix, a manifest of another format version, one missing a
field, or one whose fields the runtime cannot use (every format-2 compile writes them all; the one
optional entry is a checkpoint's `folder_relative`, absent where no relative path exists). The
JSON keys, their order and their meaning are README.md's "manifest.json". Torch-free.

DTYPES is the one table of dtype names: the short names used in manifests, checkpoint indexes
and the CLI, with their NumPy, torch, safetensors and Hugging Face config spellings.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from pathlib import Path

from dflash_iree.errors import DFlashError

# 2: what the host reads is written into the caller's buffers (entry point `writes`)
FORMAT_VERSION = 2
MANIFEST_FILE = "manifest.json"
MODULE_FILE = "dflash.vmfb"
KV_PAGE = 32  # KV cache rows per page; an attention reads pages.shape[0] * KV_PAGE rows
DRIVERS = ("local-task", "cuda", "hip")
DEPTH_COST_FILE = "depth_cost.json"  # `dflash-iree calibrate`'s cost of a round per verified rows (runtime/depth.py)
VERIFY_ROWS = "verify_rows"  # prefix of the rounds of fewer rows (export/depth_entry_points.py)


def depth_rows(block_size: int) -> list[int]:
    """The verified row counts a module of several streams compiles for block `block_size` (>= 2),
    ascending: {2, B/2, B} (why: export/depth_entry_points.py)."""
    return sorted({2, max(2, block_size // 2), block_size})


def rows_of(name: str) -> int | None:
    """R of a `verify_rows{R}` / `verify_rows{R}_sampled` entry-point name; None for any other name."""
    if not name.startswith(VERIFY_ROWS):
        return None
    digits = name[len(VERIFY_ROWS):].removesuffix("_sampled")
    return int(digits) if digits.isdigit() else None


@dataclass(frozen=True)
class DType:
    """One element type: numpy / torch attribute name ("" where none: numpy has no bfloat16, it
    comes from ml_dtypes), safetensors tag, bytes per element."""

    numpy: str
    torch: str
    safetensors: str
    bytes: int


DTYPES: dict[str, DType] = {
    "f32": DType("float32", "float32", "F32", 4),
    "f16": DType("float16", "float16", "F16", 2),
    "bf16": DType("", "bfloat16", "BF16", 2),
    "f64": DType("float64", "float64", "F64", 8),
    "i64": DType("int64", "int64", "I64", 8),
    "i32": DType("int32", "int32", "I32", 4),
    "u32": DType("uint32", "uint32", "U32", 4),  # MLX's packed 4-bit words (dflash_iree/quant.py)
    "i8": DType("int8", "int8", "I8", 1),
    "i1": DType("bool", "bool", "BOOL", 1),
}
COMPUTE_DTYPES = ("bf16", "f16", "f32")  # what a pair may be compiled in (--dtype)
# A config.json's torch_dtype -> short name (the short names themselves are accepted too).
CONFIG_DTYPES = {**{DTYPES[n].torch: n for n in COMPUTE_DTYPES}, **{n: n for n in COMPUTE_DTYPES}}
SAFETENSORS_DTYPES = {d.safetensors: n for n, d in DTYPES.items()}


def numpy_dtype(name: str):
    """The numpy dtype of a short dtype name ("bf16": ml_dtypes.bfloat16, which comes with
    iree-base-runtime). Raises KeyError for an unknown name."""
    import numpy as np

    if name == "bf16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(DTYPES[name].numpy)


# The field annotations below, as JSON types (checked on reading, so that a hand-edited manifest is
# refused by field, not met as a TypeError deep in the runtime).
_JSON_TYPES = {"int": int, "str": str, "dict": dict, "list": list}
_JSON_NAMES = {int: "an integer", str: "a string", dict: "an object", list: "a list"}
# The entry points the runtime calls on every artifact (the others are optional: sampled, draft_topk).
REQUIRED_ENTRY_POINTS = ("prefill", "verify", "decode", "absorb", "draft")


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _inconsistency(data: dict) -> str | None:
    """What, in a manifest whose fields have their types, the runtime could not use ("" or None: fine)."""
    if data["driver"] not in DRIVERS:
        return f"driver '{data['driver']}' is not one of {', '.join(DRIVERS)}"
    if data["dtype"] not in COMPUTE_DTYPES:
        return f"dtype '{data['dtype']}' is not one of {', '.join(COMPUTE_DTYPES)}"
    for name in ("max_context", "kv_page", "streams"):  # block_size's range: DrafterConfig.block, at compile
        if data[name] < 1:
            return f"{name} {data[name]} is out of range"
    if data["module"] not in data["files"]:
        return f"files does not list the module {data['module']} (no sha256 to check it by)"
    names = {e.get("name") for e in data["entry_points"] if isinstance(e, dict)}
    missing = [n for n in REQUIRED_ENTRY_POINTS if n not in names]
    if missing:
        return f"entry_points has no {', '.join(missing)}"
    for scope in ("target", "drafter"):
        if not isinstance(data[scope].get("config"), dict) or scope not in data["parameters"]:
            return f"{scope} has no config or parameters"
    if not _is_int(data["target"]["config"].get("vocab_size")):
        return "target.config has no integer vocab_size"
    if not all(_is_int(data["shapes"].get(k)) for k in ("kv_page", "tap_width")):
        return "shapes lacks kv_page or tap_width"
    if not isinstance(data["state"].get("globals"), dict):
        return "state has no globals"
    return None


@dataclass(frozen=True, kw_only=True)
class Manifest:
    """What one compile wrote, field for field as in manifest.json (README.md, "manifest.json").

    arch / driver: the compile target and the iree.runtime driver that runs it (dflash_iree/arch.py).
    target / drafter: checkpoint entries {folder, folder_relative (optional), config_hash, config,
    raw_config}. entry_points: {name, model, doc, writes, args, results} per function, each tensor
    {name, shape, dtype (a DTYPES name)}. parameters: scope -> key -> {shape, dtype}. files: name ->
    sha256 of every file of the artifact folder besides the manifest.
    """

    format_version: int = FORMAT_VERSION
    arch: str
    arch_requested: str
    arch_note: str
    driver: str
    module: str
    versions: dict
    flags: list
    splice_flags: list
    splices: dict  # what export/splice.py replaced, per splice
    target: dict
    drafter: dict
    block_size: int
    trained_block_size: int
    draft_top_k: int  # K of the draft_topk entry point; 0: none
    attention: str  # the attention form exported (export/qwen3.py)
    max_context: int
    dtype: str
    streams: int
    kv_page: int
    tap_layer_ids: list
    mask_token_id: int
    shapes: dict
    entry_points: list
    parameters: dict
    state: dict  # module-initialized mutable globals (the caches): not parameters
    stats: dict
    files: dict

    def to_json(self) -> dict:
        """The manifest.json object, keys in field order (format_version first)."""
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def dumps(self) -> str:
        """The text of manifest.json."""
        return json.dumps(self.to_json(), indent=1) + "\n"

    @classmethod
    def from_json(cls, data: dict, where: str | Path = MANIFEST_FILE) -> "Manifest":
        """The manifest of a manifest.json object; `where` names it in errors.

        Raises:
            DFlashError: not an object, another format_version, fields missing or of another JSON
                type, or values the runtime cannot use (driver, dtype, sizes, the module's sha256,
                the required entry points, each scope's config and parameters): each says to
                recompile with `dflash-iree compile` (an older dflash-iree wrote it, or it was edited).
        """
        if not isinstance(data, dict):
            raise DFlashError(f"{where} is not a JSON object; recompile with dflash-iree compile --arch ARCH "
                              "--target DIR --drafter DIR")
        fix = (f"recompile with dflash-iree compile --arch {data.get('arch', 'ARCH')} --target DIR --drafter DIR "
               f"--out {Path(where).parent}")
        version = data.get("format_version")
        if version != FORMAT_VERSION:
            raise DFlashError(f"{where}: format_version {version} is not {FORMAT_VERSION} (written by another "
                              f"dflash-iree); {fix}")
        names = [f.name for f in fields(cls)]
        missing = [n for n in names if n not in data]
        if missing:
            raise DFlashError(f"{where} has no {', '.join(missing)} (written by an older dflash-iree); {fix}")
        for f in fields(cls):
            value, kind = data[f.name], _JSON_TYPES[f.type]
            if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
                raise DFlashError(f"{where}: field {f.name} is {value!r}, not {_JSON_NAMES[kind]}; {fix}")
        problem = _inconsistency(data)
        if problem:
            raise DFlashError(f"{where}: {problem}; {fix}")
        return cls(**{n: data[n] for n in names})

    @classmethod
    def load(cls, path: str | Path) -> "Manifest":
        """Read and check manifest.json at `path` (from_json). Raises DFlashError, also for a file
        that is not JSON."""
        try:
            data = json.loads(Path(path).read_text())
        except ValueError as e:
            raise DFlashError(f"{path} is not valid JSON ({e}); recompile with dflash-iree compile") from None
        return cls.from_json(data, path)

    @property
    def eos_token_ids(self) -> list[int]:
        """The target's end-of-sequence ids (its config's eos_token_id, as a list)."""
        return list(self.target["config"].get("eos_token_ids", []))
