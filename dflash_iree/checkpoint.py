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


def _read_header(path: Path) -> dict:
    try:
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            if n > 100_000_000:
                raise ValueError("header too large")
            header = json.loads(f.read(n))
    except (OSError, ValueError, struct.error) as e:
        raise DFlashError(f"{path}: not a readable safetensors file ({e})") from None
    header.pop("__metadata__", None)
    return header


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
        except (ValueError, KeyError) as e:
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
        for key, meta in _read_header(path).items():
            dtype = SAFETENSORS_DTYPES.get(meta["dtype"], meta["dtype"].lower())
            out[key] = TensorInfo(path, dtype, tuple(meta["shape"]), tuple(meta["data_offsets"]))
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
