"""Quantize on load as the runtime binds a checkpoint: artifacts compiled with `--target-bits 4` /
`--drafter-bits 4` (issue #28).

Such a module takes that scope's linears as an MLX-written 4-bit checkpoint's operands (`X.weight`
u32 [N, K / 8], `X.scales` and `X.biases` [N, K / 64] in the checkpoint's dtype), while the
checkpoint is float. `parameter_index` makes those tensors from the float safetensors with NumPy, by
the eager reference's rule (dflash_iree/quant.py `quantize_on_load_weight`, which export/quantized.py
`quantize_on_load` comes to), so that the compiled module computes what `dflash-iree eager
--SCOPE-bits 4` does, and puts them with the checkpoint's other tensors (memory-mapped, as stored)
in the scope's parameter index.

The quantized tensors are kept in a cache file, `<cache>/quantized/<key>.safetensors` (<cache>:
dflash_iree/cache.py, $DFLASH_IREE_CACHE, else ~/.cache/dflash-iree), one per source folder and
module settings (the key hashes the folder's absolute path, the layers and their shapes, the group
and the dtypes). Its header's metadata holds `record`, what it was made from (the rule's version,
format, bits, group, compute and scale dtypes, the layers and their shapes, and each source
safetensors file's name, size and mtime), and the sha256 of its tensors (keys, dtypes, shapes,
bytes). It is bound only when that record equals the source's now and its tensors hash to that
sha256; otherwise (the source was rewritten, the file is cut off or altered, another rule) it is
made again. It is written to a temporary file beside it and renamed into place, so that no reader
sees half of one. With $DFLASH_IREE_CACHE=off, or a cache folder that cannot be written (a warning
says so), the tensors are made in memory at every load.

Each load says once per scope, at INFO on the `dflash_iree.runtime` logger (the CLI prints it on
stderr), whether the 4-bit tensors were made now (in how long, and where they are kept) or taken
from the cache.
"""

from __future__ import annotations

import hashlib
import json
import logging
import mmap
import os
import struct
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

from dflash_iree import quant
from dflash_iree.cache import cache_dir
from dflash_iree.checkpoint import read_safetensors, weight_files
from dflash_iree.errors import DFlashError
from dflash_iree.guard import DFlashWarning
from dflash_iree.manifest import DTYPES, numpy_dtype

RECORD = "dflash_iree.quantize_on_load"  # the cache header's metadata key of `record`
DIGEST = "dflash_iree.tensors_sha256"  # ... and of the sha256 of its tensors
FLOATS = ("bf16", "f16", "f32")  # what a source weight may be stored as: the rule casts it
# The planted control's switch (tests/test_quantize_on_load.py): "no-bias" writes every bias as 0, a
# quantizer that drops MLX's bias, which compiled == eager must catch. None in every real use.
PLANTED: str | None = None
log = logging.getLogger("dflash_iree.runtime")


@dataclass(frozen=True)
class OnLoad:
    """What a module compiled with `--SCOPE-bits 4` makes of a float checkpoint: the packed layers
    (prefix -> (N, K) of the float weight [N, K]), the group, the compute dtype (the manifest's
    `dtype`) and the scales' and biases' dtype (short names: "bf16", "f16", "f32")."""

    layers: dict
    group_size: int
    compute_dtype: str
    scale_dtype: str

    def keys(self) -> set[str]:
        """The module parameters made here: each layer's `weight` (packed), `scales`, `biases`."""
        return {f"{p}.{name}" for p in self.layers for name in ("weight", "scales", "biases")}


def on_load(manifest, scope: str) -> OnLoad | None:
    """The quantize on load of `scope` ("target", "drafter") that a manifest records (its
    `SCOPE.quantization.on_load`, export/compile.py), or None: the checkpoint binds as stored."""
    record = getattr(manifest, scope).get("quantization") or {}
    if not record.get("on_load"):
        return None
    params = manifest.parameters[scope]
    layers = {}
    for prefix in record["layers"]:
        N, words = params[f"{prefix}.weight"]["shape"]
        layers[prefix] = (int(N), int(words) * 32 // int(record["bits"]))
    return OnLoad(layers, int(record["group_size"]), manifest.dtype, record["on_load"]["scale_dtype"])


def source_parameters(parameters: dict, spec: OnLoad) -> dict:
    """The tensors a float checkpoint holds for a module quantized on load: the manifest's parameter
    table of the scope (key -> {shape, dtype}) with each packed layer's three operands replaced by
    its float weight `X.weight` [N, K], whose dtype is any of FLOATS (a tuple where the table has a
    name): the rule casts it."""
    out = {k: v for k, v in parameters.items() if k not in spec.keys()}
    for prefix, (N, K) in spec.layers.items():
        out[f"{prefix}.weight"] = {"shape": [N, K], "dtype": FLOATS}
    return out


def parameter_index(rt, folder: str | Path, spec: OnLoad, parameters: dict, scope: str = "checkpoint"):
    """An `iree.runtime.ParameterIndex` of every key of `parameters` (the manifest's table of the
    scope): the packed layers' tensors quantized from the float checkpoint at `folder` (from the
    cache, or made now), the others the checkpoint's own tensors, memory-mapped as stored. The
    checkpoint must have been checked against `source_parameters` first. `scope` ("target",
    "drafter") names it in the note `quantized` logs.

    Raises:
        DFlashError: a source safetensors file that cannot be read.
    """
    index = rt.ParameterIndex()
    made = quantized(folder, spec, scope)
    if isinstance(made, Path):
        index.load(str(made))  # memory-mapped
    else:
        for key, (_, array) in made.items():
            index.add_buffer(key, array.reshape(-1).view("u1"))
    for path in weight_files(folder):
        tensors, _, start = read_safetensors(path)
        wanted = [k for k in tensors if k in parameters and k not in spec.keys()]
        if not wanted:
            continue
        with open(path, "rb") as f:
            view = memoryview(mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ))  # the index keeps it alive
        for key in wanted:
            begin, end = tensors[key].offsets
            index.add_buffer(key, view[start + begin:start + end])
    return index


def quantized(folder: str | Path, spec: OnLoad, scope: str = "checkpoint") -> Path | dict:
    """The packed layers of the float checkpoint at `folder`: the path of a cache file that fits
    (`cache_file`; made now when missing, stale or corrupt), or, with no cache to write (cache off,
    or its folder not writable: a DFlashWarning), `quantize`'s tensors in memory. Logs one line at
    INFO (`log`) saying which, naming the `scope` ("target", "drafter"); where the cache cannot be
    written, the warning alone says so."""
    rec = record(folder, spec)
    path = cache_file(folder, spec)
    what = f"the {scope} {Path(folder).resolve()}"
    if path is not None and fits(path, rec, spec):
        log.info(f"{what}: its 4-bit copy (quantize on load) is reused from the cache, {path.resolve()}")
        return path
    t0 = time.perf_counter()
    tensors = quantize(folder, spec)
    made = (f"{what}: quantized to 4 bits on load ({len(spec.layers)} linears, group {spec.group_size}) in "
            f"{time.perf_counter() - t0:.1f}s")
    if path is None:
        log.info(f"{made}, in memory (DFLASH_IREE_CACHE=off)")
        return tensors
    try:
        write_cache(path, tensors, rec)
    except OSError as e:
        # resolved: a folder recorded relative to the artifacts reads compiled/host/../../models/x
        warnings.warn(f"cannot write the quantized {Path(folder).resolve()} to {path.resolve()} ({e.strerror or e}); "
                      "quantizing it in memory at every load: set DFLASH_IREE_CACHE to a writable folder",
                      DFlashWarning, stacklevel=2)
        return tensors
    log.info(f"{made}, cached as {path.resolve()}")
    return path


def record(folder: str | Path, spec: OnLoad) -> dict:
    """What a cache file of `folder` quantized for `spec` must have been made from to be bound: the
    rule (quant.ON_LOAD_RULE, format, bits, group), the dtypes, the layers and their shapes, and each
    source safetensors file's name, size and mtime (the source as it is now)."""
    source = {}
    for path in weight_files(folder):
        st = path.stat()
        source[path.name] = {"bytes": st.st_size, "mtime_ns": st.st_mtime_ns}
    return {"rule": quant.ON_LOAD_RULE, "method": quant.MLX, "bits": 4, "group_size": spec.group_size,
            "compute_dtype": spec.compute_dtype, "scale_dtype": spec.scale_dtype,
            "layers": {p: list(nk) for p, nk in sorted(spec.layers.items())}, "source": source, "planted": PLANTED}


def cache_file(folder: str | Path, spec: OnLoad) -> Path | None:
    """Where the quantized tensors of `folder` for `spec` are kept (None: $DFLASH_IREE_CACHE=off)."""
    where = cache_dir()
    if where is None:
        return None
    what = json.dumps({"folder": str(Path(folder).resolve()), "layers": sorted(spec.layers.items()),
                       "group_size": spec.group_size, "dtypes": [spec.compute_dtype, spec.scale_dtype]})
    return where / "quantized" / f"{hashlib.sha256(what.encode()).hexdigest()[:32]}.safetensors"


def quantize(folder: str | Path, spec: OnLoad) -> dict:
    """key -> (dtype name, numpy array) of every packed layer of `spec`, made from the float
    checkpoint at `folder` by quant.quantize_on_load_weight: `X.weight` ("u32", uint32 [N, K / 8]),
    `X.scales` and `X.biases` (scale dtype, [N, K / group])."""
    import numpy as np

    compute, scale = numpy_dtype(spec.compute_dtype), numpy_dtype(spec.scale_dtype)
    where = {}
    for path in weight_files(folder):
        tensors, _, start = read_safetensors(path)
        where.update({k: (info, start) for k, info in tensors.items()})
    out = {}
    for prefix in sorted(spec.layers):
        info, start = where[f"{prefix}.weight"]
        w = np.memmap(info.file, dtype=numpy_dtype(info.dtype), mode="r", offset=start + info.offsets[0],
                      shape=info.shape)
        packed, scales, biases = quant.quantize_on_load_weight(w, compute, scale, spec.group_size)
        if PLANTED == "no-bias":
            biases = np.zeros_like(biases)
        out[f"{prefix}.weight"] = ("u32", packed)
        out[f"{prefix}.scales"] = (spec.scale_dtype, scales)
        out[f"{prefix}.biases"] = (spec.scale_dtype, biases)
    return out


def _digest(items) -> str:
    """sha256 of (key, dtype name, shape, bytes) items, in key order."""
    h = hashlib.sha256()
    for key, dtype, shape, data in sorted(items, key=lambda item: item[0]):
        h.update(json.dumps([key, dtype, list(shape)]).encode())
        h.update(data)
    return h.hexdigest()


def write_cache(path: Path, tensors: dict, rec: dict) -> None:
    """Write `tensors` (key -> (dtype name, array)) as a safetensors file at `path`, `rec` and their
    sha256 in its header's metadata; through a temporary file in the same folder, renamed into place
    when whole (an interrupted write leaves no file at `path`).

    Raises:
        OSError: the folder cannot be made or written.
    """
    import numpy as np

    arrays = {k: (dtype, np.ascontiguousarray(a)) for k, (dtype, a) in tensors.items()}
    metadata = {RECORD: json.dumps(rec, sort_keys=True),
                DIGEST: _digest((k, d, a.shape, a.reshape(-1).view("u1")) for k, (d, a) in arrays.items())}
    # wider elements first, so that each tensor starts aligned to its own size (the header is padded to 8)
    order = sorted(arrays, key=lambda k: (-DTYPES[arrays[k][0]].bytes, k))
    header, offset = {"__metadata__": metadata}, 0
    for key in order:
        dtype, a = arrays[key]
        header[key] = {"dtype": DTYPES[dtype].safetensors, "shape": list(a.shape),
                       "data_offsets": [offset, offset + a.nbytes]}
        offset += a.nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.{os.getpid()}.partial")
    try:
        with open(partial, "wb") as f:
            f.write(struct.pack("<Q", len(blob)) + blob)
            for key in order:
                f.write(arrays[key][1].reshape(-1).view("u1").data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(partial, path)
    finally:
        partial.unlink(missing_ok=True)


def fits(path: Path, rec: dict, spec: OnLoad) -> bool:
    """Whether the cache file at `path` may be bound: it is a whole safetensors file, its record is
    `rec`, it holds exactly `spec`'s keys, and its tensors hash to the sha256 it records."""
    if not path.is_file():
        return False
    try:
        tensors, metadata, start = read_safetensors(path)
        if json.loads(metadata.get(RECORD, "null")) != json.loads(json.dumps(rec)) or set(tensors) != spec.keys():
            return False
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
            view = memoryview(mm)
            try:
                digest = _digest((k, i.dtype, i.shape, view[start + i.offsets[0]:start + i.offsets[1]])
                                 for k, i in tensors.items())
            finally:
                view.release()
    except (DFlashError, OSError, ValueError):
        return False
    return digest == metadata.get(DIGEST)
