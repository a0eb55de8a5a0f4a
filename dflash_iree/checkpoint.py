"""Index the safetensors weights of an HF checkpoint folder without loading them.

Reads only the JSON headers of `model.safetensors` or of the shards listed in
`model.safetensors.index.json`, so the compiler front end and the runtime can check keys, shapes
and dtypes before any tensor is touched. Torch-free.
"""

from __future__ import annotations

import hashlib
import json
import struct
from dataclasses import dataclass
from pathlib import Path

from .errors import DFlashError

from .manifest import SAFETENSORS_DTYPES  # safetensors dtype tags -> our short names


@dataclass(frozen=True)
class TensorInfo:
    """Where one tensor lives: file, dtype (short name), shape, byte range in the file."""

    file: Path
    dtype: str
    shape: tuple[int, ...]
    offsets: tuple[int, int]


# bytes per element of each safetensors dtype tag (the format's own list)
ITEMSIZE = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
            "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8}
MAX_HEADER = 100_000_000  # the safetensors reference implementation's limit


def _read_header(path: Path) -> tuple[dict, dict, int]:
    """The tensor entries of a safetensors file's JSON header, checked against the file's size; its
    `__metadata__` ({} when none); the file offset its data starts at.

    Format (huggingface/safetensors, "Format"): 8 bytes little-endian header length N, N bytes of
    JSON {key: {dtype, shape, data_offsets: [begin, end]}} (offsets into the data that follows), then
    the data. A file cut off mid-tensor (an interrupted download or copy) is caught here, by name,
    before IREE maps it.

    Raises:
        DFlashError: unreadable file, a header that is not that JSON, or a tensor whose byte range
            does not match its shape and dtype or lies past the end of the file.
    """
    def bad(why: str):
        raise DFlashError(f"{path}: not a whole safetensors file ({why}); download or copy it again")

    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                bad(f"{size} bytes, shorter than the 8-byte header length")
            (n,) = struct.unpack("<Q", head)
            if n > MAX_HEADER or 8 + n > size:
                bad(f"its header length {n} runs past the file's {size} bytes")
            header = json.loads(f.read(n))
    except OSError as e:
        raise DFlashError(f"{path}: cannot read it ({e.strerror or e})") from None
    except (ValueError, UnicodeDecodeError) as e:
        bad(f"the header is not JSON: {e}")
    if not isinstance(header, dict):
        bad("the header is not a JSON object")
    metadata = header.pop("__metadata__", None)
    data = size - 8 - n
    for key, meta in header.items():
        try:
            begin, end = (int(x) for x in meta["data_offsets"])
            elements = 1
            for d in meta["shape"]:
                elements *= int(d)
            nbytes = elements * ITEMSIZE[meta["dtype"]]
        except (KeyError, TypeError, ValueError):
            bad(f"tensor {key}: no valid dtype, shape and data_offsets")
        if not 0 <= begin <= end or end - begin != nbytes:
            bad(f"tensor {key}: data_offsets {[begin, end]} do not hold {meta['dtype']} {list(meta['shape'])}")
        if end > data:
            bad(f"tensor {key} ends at data byte {end} but the file holds {data} bytes of data: it was cut off")
    return header, metadata if isinstance(metadata, dict) else {}, 8 + n


def read_safetensors(path: str | Path) -> tuple[dict[str, TensorInfo], dict, int]:
    """One safetensors file's tensors (key -> TensorInfo, offsets into its data), its header's
    `__metadata__` (str -> str; {} when none), and the file offset its data starts at.

    Raises:
        DFlashError: as `_read_header`: unreadable, not that JSON, or cut off.
    """
    path = Path(path)
    header, metadata, start = _read_header(path)
    tensors = {key: TensorInfo(path, SAFETENSORS_DTYPES.get(m["dtype"], m["dtype"].lower()), tuple(m["shape"]),
                               tuple(m["data_offsets"])) for key, m in header.items()}
    return tensors, metadata, start


def weight_files(folder: str | Path) -> list[Path]:
    """The safetensors files of a checkpoint folder: `model.safetensors`, or the shards of its index.

    Raises:
        DFlashError: neither file exists, or the index names a shard that is missing.
    """
    folder = Path(folder)
    single = folder / "model.safetensors"
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise DFlashError(f"{index}: not a safetensors index ({e})") from None
        files = [folder / n for n in names]
        for f in files:
            if not f.is_file():
                raise DFlashError(f"{index} names shard {f.name}, which is missing from {folder}")
        return files
    if single.is_file():
        return [single]
    raise DFlashError(f"{folder}: no model.safetensors or model.safetensors.index.json; weights must be in safetensors format")


def index_checkpoint(folder: str | Path) -> dict[str, TensorInfo]:
    """Map every tensor key of a checkpoint folder to its file, dtype and shape (headers only)."""
    out: dict[str, TensorInfo] = {}
    for path in weight_files(folder):
        out.update(read_safetensors(path)[0])
    return out


def check_tensors(
    folder: str | Path, expected: dict[str, tuple[int, ...]], dtype: str | None = None
) -> dict[str, TensorInfo]:
    """Check that every expected key exists with the expected shape (and dtype, when given).

    Args:
        folder: checkpoint folder.
        expected: key -> shape the model needs.
        dtype: "bf16" | "f16" | "f32" to require that dtype too, or None to accept any float type.

    Returns:
        The index entries of the expected keys.

    Raises:
        DFlashError: listing every missing key and every mismatched shape or dtype, each with the
            expected and the found value.
    """
    index = index_checkpoint(folder)
    problems = []
    for key, shape in expected.items():
        info = index.get(key)
        if info is None:
            problems.append(f"  {key}: missing (expected shape {list(shape)})")
        elif tuple(info.shape) != tuple(shape):
            problems.append(f"  {key}: expected shape {list(shape)}, found {list(info.shape)} in {info.file.name}")
        elif dtype is not None and info.dtype != dtype:
            problems.append(f"  {key}: expected dtype {dtype}, found {info.dtype} in {info.file.name}")
    if problems:
        raise DFlashError(f"checkpoint {folder} does not match its config.json:\n" + "\n".join(problems))
    return {k: index[k] for k in expected}


def sha256_file(path: str | Path) -> str:
    """Hex sha256 of a file, read in 1 MiB chunks (manifests record one per artifact file)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()
