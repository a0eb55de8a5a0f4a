"""4-bit weight formats: what a checkpoint's config.json says, and whether its packed tensors fit it.

Torch-free, so that the compiler front end, the eager loader and the runtime share one reading.
Two formats are read as they are stored, with no conversion step:

- MLX affine (mlx-lm `convert -q`; `config.json` `quantization: {group_size, bits, mode: affine}`):
  a linear or embedding `X` stores `X.weight` uint32 [N, K / 8], eight 4-bit values q in [0, 15]
  per word along the input dim, value j in bits 4j..4j+3 (low nibble first), and `X.scales`,
  `X.biases` [N, K / group_size] (the checkpoint's float dtype); w = scale * q + bias
  (ml-explore/mlx `mlx/ops.cpp` `dequantize`). A layer left unquantized keeps `X.weight` as a float.
- compressed-tensors `pack-quantized` W4A16 (`quantization_config.quant_method: compressed-tensors`,
  one weights scheme with num_bits 4, type int, strategy group): `X.weight_packed` int32 [N, K / 8],
  in the same nibble order, each value stored as q + 8 (q in [-8, 7]); `X.weight_scale`
  [N, K / group_size]; `X.weight_shape` int64 [2] = [N, K]; when asymmetric `X.weight_zero_point`
  int32 [ceil(N / 8), K / group_size], packed the same way along the output dim (also + 8);
  w = (q - zero_point) * scale (neuralmagic/compressed-tensors
  `compressors/pack_quantized/helpers.py` `pack_to_int32`, `quantization/lifecycle/forward.py`).

Both become one internal form, `QuantLayer`: packed nibbles u in [0, 15] laid out as MLX stores
them, and per group a scale and an offset, w = scale * (u - offset) for compressed-tensors
(offset = 8 + zero_point) and w = scale * u + bias for MLX. `quantize_affine` makes the MLX form from
a float weight (`--target-bits 4` / `--drafter-bits 4`, quantize on load); `quantize_on_load_weight`
is the whole rule, from the stored weight, that the eager loader and the runtime's binder share.

Refused, each with one line and the fix: GPTQ, AWQ, GGUF, FP8 (and other quant_methods) by name,
bits other than ACCEPTED_BITS, group sizes other than GROUP_SIZES, activation quantization, a
`quantization` and `quantization_config` that disagree, and packed tensors of the wrong shape.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from .errors import DFlashError

ACCEPTED_BITS = (4,)
# Input columns per scale the dequantizing matmul takes: each divides a 128-wide K tile.
GROUP_SIZES = (32, 64, 128)
ON_LOAD_GROUP = 64  # quantize on load: affine 4-bit, group 64 (the MLX default)
# The version of quantize on load's rule (`quantize_on_load_weight`): the runtime's cached quantized
# tensors record it, so that a cache made by another rule is made again, never bound.
ON_LOAD_RULE = 1
MLX = "mlx-affine"
CT = "compressed-tensors"
# quant_methods users meet that are not read yet, with the name to refuse them by
_NAMED = {"gptq": "GPTQ", "awq": "AWQ", "fp8": "FP8", "gguf": "GGUF", "bitsandbytes": "bitsandbytes",
          "hqq": "HQQ", "aqlm": "AQLM", "exl2": "EXL2", "marlin": "GPTQ (Marlin)", "fbgemm_fp8": "FP8"}
_READ = f"4-bit MLX affine ({MLX}) or compressed-tensors pack-quantized W4A16"


@dataclass(frozen=True)
class QuantFormat:
    """A checkpoint's 4-bit format: `method` (MLX or CT), bits, group_size (input columns per scale),
    symmetric (compressed-tensors only: no zero points; MLX affine always has biases, and the field
    stays at its default there), and the layers the config leaves unquantized
    (`ignore`: module paths; a layer whose tensors are float is unquantized either way). `on_load`:
    not the checkpoint's (a float one) but the MLX form quantize on load gives it (`on_load_format`)."""

    method: str
    bits: int
    group_size: int
    symmetric: bool = True
    ignore: tuple[str, ...] = ()
    source: str = ""  # the config.json it came from
    on_load: bool = False

    def to_dict(self) -> dict:
        """The manifest's record of the format (`format_fields`): method, bits, group_size, and
        `symmetric` for compressed-tensors only."""
        return format_fields({"method": self.method, "bits": self.bits, "group_size": self.group_size,
                              "symmetric": self.symmetric})


def format_fields(record: dict) -> dict:
    """The fields of a quantization record (a manifest's `SCOPE.quantization`, or
    `QuantFormat.to_dict`) that name its format: method, bits, group_size, and `symmetric` only for
    compressed-tensors, where it says whether there are zero points. MLX affine has biases whatever
    the field says, so it is dropped there (manifests written before recorded `symmetric: true` for
    MLX; they compare equal to the ones written now)."""
    out = {k: record[k] for k in ("method", "bits", "group_size")}
    if record["method"] == CT:
        out["symmetric"] = record["symmetric"]
    return out


def _bits(bits, where: str) -> int:
    if bits not in ACCEPTED_BITS:
        raise DFlashError(f"{where}: {bits}-bit weights are not supported; accepted bits: "
                          f"{', '.join(map(str, ACCEPTED_BITS))} (quantize the checkpoint to 4 bits)")
    return int(bits)


def _group(group, where: str) -> int:
    if group not in GROUP_SIZES:
        raise DFlashError(f"{where}: group_size {group} is not supported by the dequantizing matmul; use one of "
                          f"{', '.join(map(str, GROUP_SIZES))} (quantize the checkpoint again with one of them)")
    return int(group)


def _mlx(q: dict, path: Path) -> QuantFormat:
    where = f"{path} quantization"
    mode = q.get("mode", "affine")
    if mode != "affine":
        raise DFlashError(f"{where}.mode '{mode}' is not supported; only MLX affine quantization is read "
                          "(mlx_lm.convert -q --q-mode affine)")
    bits = _bits(q.get("bits"), f"{where}.bits")
    group = _group(q.get("group_size"), f"{where}.group_size")
    ignore = []
    for key, value in q.items():  # mlx-lm's per-layer entries: a module path -> False or its own settings
        if key in ("group_size", "bits", "mode"):
            continue
        if value is False:
            ignore.append(key)
        elif isinstance(value, dict):
            if value.get("bits", bits) != bits or value.get("group_size", group) != group \
                    or value.get("mode", mode) != mode:
                raise DFlashError(f"{where}.{key} is {value}, unlike the model's bits {bits}, group_size {group}: "
                                  "mixed-precision MLX checkpoints are not supported; quantize all layers alike")
    return QuantFormat(MLX, bits, group, True, tuple(ignore), str(path))


def _compressed_tensors(q: dict, path: Path) -> QuantFormat:
    where = f"{path} quantization_config"
    fmt = q.get("format")
    if fmt != "pack-quantized":
        if fmt in ("float-quantized", "naive-quantized") and "float" in str(q):
            raise DFlashError(f"{where}: FP8 checkpoints are not supported yet; use a {_READ} checkpoint")
        raise DFlashError(f"{where}.format '{fmt}' is not supported; only pack-quantized W4A16 is read "
                          "(llm-compressor's W4A16 scheme)")
    groups = q.get("config_groups") or {}
    schemes = [g.get("weights") or {} for g in groups.values()]
    if not schemes:
        raise DFlashError(f"{where}.config_groups has no weights scheme; the checkpoint is not W4A16")
    for name, g in groups.items():
        if g.get("input_activations") or g.get("output_activations"):
            raise DFlashError(f"{where}.config_groups.{name} quantizes activations; only W4A16 (weights only) is "
                              "supported")
    first = schemes[0]
    if any(s != first for s in schemes[1:]):
        raise DFlashError(f"{where}.config_groups have different weights schemes; only one W4A16 scheme for all "
                          "layers is supported")
    if first.get("type", "int") != "int":
        raise DFlashError(f"{where}: weights of type '{first.get('type')}' (FP8/FP4) are not supported; use a "
                          f"{_READ} checkpoint")
    bits = _bits(first.get("num_bits"), f"{where}.config_groups weights.num_bits")
    if first.get("strategy") != "group":
        raise DFlashError(f"{where}: weights strategy '{first.get('strategy')}' is not supported; only 'group' "
                          "(one scale per group of input columns) is")
    group = _group(first.get("group_size"), f"{where}.config_groups weights.group_size")
    ignore = tuple(str(i) for i in q.get("ignore") or ())
    return QuantFormat(CT, bits, group, bool(first.get("symmetric", True)), ignore, str(path))


def read_format(raw: dict, path: str | Path) -> QuantFormat | None:
    """The 4-bit format a config.json (`raw`, read from `path`) declares; None for a float checkpoint.

    Raises:
        DFlashError: a format or setting that is not read (module docstring), or a `quantization`
            and a `quantization_config` that disagree.
    """
    path = Path(path)
    mlx, qc = raw.get("quantization"), raw.get("quantization_config")
    if qc is not None and not isinstance(qc, dict) or mlx is not None and not isinstance(mlx, dict):
        raise DFlashError(f"{path}: quantization / quantization_config is not an object; fix the config.json")
    method = (qc or {}).get("quant_method")
    if mlx is not None:
        # mlx-lm writes both, the same settings: any other quantization_config contradicts it
        if qc is not None and (method is not None or any(qc.get(k) != mlx.get(k) for k in ("bits", "group_size"))):
            raise DFlashError(f"{path}: quantization {mlx} and quantization_config "
                              f"{ {k: qc.get(k) for k in ('quant_method', 'bits', 'group_size') if k in qc} } "
                              "disagree; keep the one the checkpoint's tensors were written with")
        return _mlx(mlx, path)
    if qc is None:
        return None
    if method == "compressed-tensors":
        return _compressed_tensors(qc, path)
    name = _NAMED.get(str(method).lower(), f"quant_method '{method}'")
    raise DFlashError(f"{path}: {name} checkpoints are not supported yet; use a {_READ} checkpoint, "
                      "or a bf16 one with --target-bits 4 / --drafter-bits 4")


def refuse_gguf(folder: str | Path) -> None:
    """A folder holding .gguf files and no safetensors: refused by name (raises DFlashError)."""
    folder = Path(folder)
    if folder.is_dir() and any(folder.glob("*.gguf")) and not any(folder.glob("*.safetensors")):
        raise DFlashError(f"{folder}: GGUF checkpoints are not supported yet; use a {_READ} checkpoint in "
                          "safetensors, or a bf16 one with --target-bits 4 / --drafter-bits 4")


def check_bits(bits, option: str) -> int | None:
    """A quantize-on-load option (--target-bits, --drafter-bits): None (keep the stored dtype) or 4.

    Raises:
        DFlashError: any other value, naming the option and the accepted bits.
    """
    if bits is None:
        return None
    if bits not in ACCEPTED_BITS:
        raise DFlashError(f"{option} {bits} is not supported; accepted: {', '.join(map(str, ACCEPTED_BITS))} "
                          f"(affine, group {ON_LOAD_GROUP}), or leave it out to keep the checkpoint's dtype")
    return int(bits)


def on_load_format(source: str = "") -> QuantFormat:
    """The format `--target-bits 4` / `--drafter-bits 4` give a float checkpoint (`source`: its
    config.json): MLX affine, 4 bits, group ON_LOAD_GROUP."""
    return QuantFormat(MLX, 4, ON_LOAD_GROUP, source=source, on_load=True)


@dataclass(frozen=True)
class QuantLayer:
    """One quantized linear or embedding `prefix` of a checkpoint: its output and input sizes N, K,
    the format, and the checkpoint keys of its tensors (`keys`: role -> key; roles `packed`, `scales`,
    and `biases` (MLX) or `zeros` (compressed-tensors, asymmetric) and `shape`)."""

    prefix: str
    N: int
    K: int
    fmt: QuantFormat
    keys: dict = field(default_factory=dict)

    @property
    def packed_bytes(self) -> int:
        """Bytes of the packed weight alone (N * K / 2)."""
        return self.N * self.K // 2


def _expect(index, key: str, shape: tuple, dtypes: tuple, problems: list) -> None:
    info = index.get(key)
    if info is None:
        problems.append(f"{key}: missing (expected {'/'.join(dtypes)} {list(shape)})")
    elif tuple(info.shape) != tuple(shape):
        problems.append(f"{key}: expected shape {list(shape)}, found {list(info.shape)} in {info.file.name}")
    elif info.dtype not in dtypes:
        problems.append(f"{key}: expected dtype {'/'.join(dtypes)}, found {info.dtype} in {info.file.name}")


def find_layers(index: dict, fmt: QuantFormat, shapes: dict[str, tuple[int, int]], folder) -> dict[str, QuantLayer]:
    """The quantized layers among `shapes` (module prefix -> its float weight's [N, K]).

    A prefix is quantized when the checkpoint stores its packed tensor (`X.scales` for MLX,
    `X.weight_packed` for compressed-tensors) and stays in its stored dtype otherwise (norms,
    often lm_head). Every quantized layer's tensors are checked against [N, K] and the group size.

    Raises:
        DFlashError: one line naming the first packed tensor of the wrong shape or dtype, how many
            more there are, and the fix.
    """
    out, problems = {}, []
    g = fmt.group_size
    floats = ("bf16", "f16", "f32")
    for prefix, (N, K) in shapes.items():
        if fmt.method == MLX and f"{prefix}.scales" in index:
            keys = {"packed": f"{prefix}.weight", "scales": f"{prefix}.scales", "biases": f"{prefix}.biases"}
            if K % g:
                problems.append(f"{prefix}: K = {K} is not a multiple of group_size {g}")
                continue
            _expect(index, keys["packed"], (N, K * fmt.bits // 32), ("u32",), problems)
            for role in ("scales", "biases"):
                _expect(index, keys[role], (N, K // g), floats, problems)
        elif fmt.method == CT and f"{prefix}.weight_packed" in index:
            keys = {"packed": f"{prefix}.weight_packed", "scales": f"{prefix}.weight_scale",
                    "shape": f"{prefix}.weight_shape"}
            if K % g:
                problems.append(f"{prefix}: K = {K} is not a multiple of group_size {g}")
                continue
            _expect(index, keys["packed"], (N, K * fmt.bits // 32), ("i32",), problems)
            _expect(index, keys["scales"], (N, K // g), floats, problems)
            _expect(index, keys["shape"], (2,), ("i64", "i32"), problems)
            if not fmt.symmetric:
                keys["zeros"] = f"{prefix}.weight_zero_point"
                _expect(index, keys["zeros"], (-(-N * fmt.bits // 32), K // g), ("i32",), problems)
        else:
            continue
        out[prefix] = QuantLayer(prefix, N, K, fmt, keys)
    if problems:  # one line: the first problem and a count (a wrong file mismatches every layer)
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        raise DFlashError(f"checkpoint {folder}: packed 4-bit tensors do not match its config.json ({fmt.method}, "
                          f"group_size {g}): {problems[0]}{more}; download or quantize it again")
    return out


def quantize_affine(w, group_size: int = ON_LOAD_GROUP, scale_dtype=None):
    """Affine 4-bit quantization of a float weight, in MLX's layout (quantize on load).

    Per group of `group_size` input columns: bias = min, scale = (max - min) / 15, rounded to
    `scale_dtype` (the weight's dtype by default) before q is chosen, so that w ~ scale * q + bias
    holds with the stored scale and bias; q = clip(round((w - bias) / scale), 0, 15) in float32. A
    scale that is 0 in `scale_dtype` (a constant group, or a range below its smallest step) is 1: a
    zero scale would divide by zero, and the group is its bias either way. (mlx's own `quantize` also nudges the bias so that 0 is exact; this one does
    not, and says so: it is our quantizer, checked by its error bound, not by MLX's bits.)

    Args:
        w: numpy float array [N, K] (bf16 via ml_dtypes, f16 or f32), K a multiple of group_size.

    Returns:
        (packed uint32 [N, K / 8], scales [N, K / group_size], biases [N, K / group_size]), the
        scales and biases in `scale_dtype`.
    """
    import numpy as np

    N, K = w.shape
    scale_dtype = scale_dtype or w.dtype
    g = w.astype(np.float32).reshape(N, K // group_size, group_size)
    lo, hi = g.min(-1), g.max(-1)
    scale = ((hi - lo) / 15.0).astype(scale_dtype)
    scale = np.where(scale > 0, scale, 1.0).astype(scale_dtype)
    bias = lo.astype(scale_dtype)
    s32, b32 = scale.astype(np.float32)[..., None], bias.astype(np.float32)[..., None]
    q = np.clip(np.rint((g - b32) / s32), 0, 15).astype(np.uint8).reshape(N, K)
    return pack_nibbles(q), scale, bias


def quantize_on_load_weight(w, compute_dtype, scale_dtype, group_size: int = ON_LOAD_GROUP):
    """Quantize on load's rule for one float weight as a checkpoint stores it: the weight as the
    compute dtype holds it (the eager reference loads it so), in the checkpoint's dtype, by
    `quantize_affine`. export/quantized.py `quantize_on_load` (eager, torch casts) and the runtime's
    binder (runtime/quantize_on_load.py, NumPy casts) both come to this; tests/test_quantize_on_load.py
    holds them equal bit for bit.

    Args:
        w: numpy float array [N, K] in the checkpoint's stored dtype (bf16 via ml_dtypes, f16, f32).
        compute_dtype: numpy dtype of the module's activations (--dtype).
        scale_dtype: numpy dtype of the checkpoint's config.json torch_dtype: the scales' and biases'.

    Returns:
        `quantize_affine`'s (packed uint32 [N, K / 8], scales, biases [N, K / group_size] in scale_dtype).
    """
    import numpy as np

    # through float32 as torch's `.float().numpy()` goes: each cast rounds once, to nearest even
    w = np.asarray(w).astype(compute_dtype).astype(np.float32).astype(scale_dtype)
    return quantize_affine(w, group_size, scale_dtype)


def pack_nibbles(q):
    """uint8 values in [0, 15], [N, K] (K a multiple of 8) -> uint32 [N, K / 8], value j of a word in
    bits 4j..4j+3 (MLX's and compressed-tensors' order; little-endian bytes: two values a byte, low
    nibble first)."""
    import numpy as np

    byte = (q[:, 0::2] | (q[:, 1::2] << 4)).astype(np.uint8)
    return np.ascontiguousarray(byte).view("<u4")


def unpack_nibbles(packed):
    """`pack_nibbles` reversed: uint32 or int32 [N, W] -> uint8 [N, 8 W] in [0, 15]."""
    import numpy as np

    b = np.ascontiguousarray(packed).view(np.uint8)
    return np.stack([b & 15, b >> 4], -1).reshape(b.shape[0], -1)
