"""4-bit linears and embeddings, eager and exported: packed weights kept packed, dequantized per call.

Exported (the host's compiled path, export/aot.py `build_pair`), the same modules put their packed
tensors in the module as external parameters under the checkpoint's keys and `dequantize` in the
graph; MLX's words are recorded as `u32` in the manifest (`QuantLinear.stored_dtypes`).

The formats and their checks are dflash_iree/quant.py's; this file holds the torch side:
- `QuantLinear` / `QuantEmbedding`: parameters named and shaped as the checkpoint stores them
  (MLX: `weight` int32 [N, K / 8], `scales`, `biases`; compressed-tensors: `weight_packed`,
  `weight_scale`, `weight_shape`, `weight_zero_point`), so a module binds a checkpoint by key as the
  float modules do;
- `swap_quantized`: replaces a (meta) model's nn.Linear / nn.Embedding by them where the
  checkpoint stores a layer packed;
- `quantize_on_load`: the MLX affine form of a loaded float model's linears (`--target-bits 4`);
  `swap_on_load`: the same layers' packed modules on the meta device, for the export.

The reference's precision: the weight is dequantized in float32 from the stored integers and the
stored scales, biases or zero points (w = scale * q + bias for MLX, w = scale * (q - zero_point)
for compressed-tensors: the products are exact in float32, MLX's bias add is one float32
rounding), then rounded once to the compute dtype (--dtype); the matmul runs in the compute dtype,
as for float weights. The int32 view of MLX's uint32 words holds the same bits (torch has no
arithmetic on uint32).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dflash_iree.quant import CT, MLX, ON_LOAD_GROUP, QuantFormat, QuantLayer, quantize_affine

def unpack(packed: torch.Tensor) -> torch.Tensor:
    """int32 [R, W] of eight 4-bit values a word (value j in bits 4j..4j+3) -> int32 [R, 8 W] in [0, 15]."""
    # made in place, not a module constant: a moved constant exports as prims.device_put, which
    # iree-compile cannot legalize
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=packed.device)
    return torch.bitwise_and(torch.bitwise_right_shift(packed[..., None], shifts), 15).reshape(packed.shape[0], -1)


def _affine(packed: torch.Tensor, scales: torch.Tensor, biases: torch.Tensor, g: int, dtype) -> torch.Tensor:
    """MLX's w = scale * u + bias in float32 for packed int32 [R, K / 8] with scales, biases [R, K / g],
    rounded to `dtype`: [R, K]."""
    R = packed.shape[0]
    u = unpack(packed).reshape(R, -1, g).float()
    s = scales.float()[..., None]
    w = s * u if PLANTED == "no-bias" else s * u + biases.float()[..., None]
    return w.reshape(R, -1).to(dtype)


def dequantize(layer: "QuantLinear", dtype: torch.dtype) -> torch.Tensor:
    """The float weight [N, K] of a packed layer, computed in float32 and rounded to `dtype`.

    One form for the eager reference and the export (the compiled graph computes exactly these
    float32 operations): the nibbles as [N, K / g, g], each group's scale and bias or offset
    broadcast over its g columns (the grouped form of experiments/2026-12-02-quant-fusion/). The GPU
    kernels compute the same values in registers (kernels/gemm/gemm_body.h, "Packed 4-bit weights").
    `PLANTED` set to "no-bias" drops MLX's bias / compressed-tensors' zero point (offset 8): the
    planted control of the tests, which compiled == eager must catch.
    """
    g, N, K = layer.group_size, layer.N, layer.K
    if layer.method == MLX:
        return _affine(layer.packed(), layer.scales, layer.biases, g, dtype)
    u = unpack(layer.packed()).reshape(N, K // g, g).float()
    if layer.symmetric or PLANTED == "no-bias":
        offset = torch.full((N, K // g, 1), 8.0, dtype=torch.float32, device=u.device)
    else:  # zero points are packed along the output dim (compressed-tensors packed_dim=0)
        offset = unpack(layer.weight_zero_point.t().contiguous()).t()[:N].float()[..., None]
    w = (u - offset) * layer.weight_scale.float()[..., None]
    return w.reshape(N, K).to(dtype)


# The planted control's switch (`dequantize`): None in every real use.
PLANTED: str | None = None


def _param(shape, dtype, device) -> nn.Parameter:
    return nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False)


class QuantLinear(nn.Module):
    """y = x . W^T with W stored packed (dflash_iree/quant.py's formats), dequantized each call.

    Args:
        layer: the checkpoint layer (N outputs, K inputs, format and keys).
        dtypes: checkpoint key -> its torch dtype (the scales' stored dtype is kept).
        compute_dtype: the dtype W is dequantized to and x is in.
        device: "meta" to build without memory (load_weights then fills the parameters).

    forward: x [..., K] in compute_dtype -> [..., N] in compute_dtype.
    """

    bias = None  # the named ops take bias-free linears (export/qwen3.py `_named`)

    def __init__(self, layer: QuantLayer, dtypes: dict, compute_dtype: torch.dtype, device=None):
        super().__init__()
        self.N, self.K = layer.N, layer.K
        self.method, self.group_size, self.symmetric = layer.fmt.method, layer.fmt.group_size, layer.fmt.symmetric
        self.compute_dtype = compute_dtype
        self.roles = {}  # role -> parameter name
        # parameter name -> the checkpoint's dtype name where the torch parameter's differs (MLX's
        # uint32 words held as int32): what the manifest's parameter table records and binds
        self.stored_dtypes = {}
        for role, key in layer.keys.items():
            name = key[len(layer.prefix) + 1:]
            dtype = torch.int32 if role in ("packed", "zeros") else dtypes[key]
            shape = {"packed": (self.N, self.K // 8), "shape": (2,)}.get(role)
            if role == "zeros":
                shape = (-(-self.N // 8), self.K // self.group_size)
            shape = shape or (self.N, self.K // self.group_size)
            setattr(self, name, _param(shape, dtype, device))
            self.roles[role] = name
            if role == "packed" and layer.fmt.method == MLX:
                self.stored_dtypes[name] = "u32"

    def packed(self) -> torch.Tensor:
        """int32 [N, K / 8], the packed weight."""
        return getattr(self, self.roles["packed"])

    def scale_tensor(self) -> torch.Tensor:
        """[N, K / group] in the stored dtype: MLX's scales or compressed-tensors' weight_scale."""
        return getattr(self, self.roles["scales"])

    def offset_tensor(self) -> torch.Tensor | None:
        """MLX's biases [N, K / group] (stored dtype), compressed-tensors' zero points int32
        [ceil(N / 8), K / group] (asymmetric), or None (symmetric: offset 8)."""
        role = "biases" if self.method == MLX else "zeros"
        return getattr(self, self.roles[role]) if role in self.roles else None

    @property
    def dtype(self) -> torch.dtype:
        return self.compute_dtype

    def dequantized(self) -> torch.Tensor:
        """The weight [N, K] in the compute dtype (`dequantize`). Kept between calls while the packed
        tensors are unchanged (their versions): an eager decode step would otherwise dequantize
        every layer again; the cache is never a parameter or buffer, so no checkpoint or export sees it."""
        if torch.compiler.is_exporting() or torch.compiler.is_compiling():
            return dequantize(self, self.compute_dtype)  # in the graph, from the bound packed tensors
        key = tuple((p.data_ptr(), p._version) for p in self._parameters.values()) + (PLANTED,)
        cached = self.__dict__.get("_dequantized")
        if cached is None or cached[0] != key:
            cached = (key, dequantize(self, self.compute_dtype))
            self.__dict__["_dequantized"] = cached
        return cached[1]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.dequantized())


class QuantEmbedding(QuantLinear):
    """An MLX-quantized embedding [vocab, hidden]: forward(ids int64 [...]) -> [..., hidden] in the
    compute dtype; `as_linear` is the tied lm_head on the same parameters."""

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if not (torch.compiler.is_exporting() or torch.compiler.is_compiling()):
            return F.embedding(ids, self.dequantized())
        # Exported: only the rows the ids pick are dequantized (the same values): the whole table's
        # dequantization would be a dispatch writing a [vocab, hidden] tensor every call.
        flat = ids.reshape(-1)
        rows = _affine(self.packed()[flat], self.scale_tensor()[flat], self.offset_tensor()[flat], self.group_size,
                       self.compute_dtype)
        return rows.reshape(*ids.shape, self.K)

    def as_linear(self) -> QuantLinear:
        lin = QuantLinear.__new__(QuantLinear)
        nn.Module.__init__(lin)
        lin.__dict__.update({k: v for k, v in self.__dict__.items() if k not in ("_parameters", "_modules")})
        for name, p in self._parameters.items():
            lin.register_parameter(name, p)
        return lin


def float_shapes(module: nn.Module) -> dict[str, tuple[int, int]]:
    """Module prefix -> [N, K] of every nn.Linear and nn.Embedding (the layers a format may pack)."""
    out = {}
    for name, m in module.named_modules():
        if isinstance(m, nn.Linear):
            out[name] = (m.out_features, m.in_features)
        elif isinstance(m, nn.Embedding):
            out[name] = (m.num_embeddings, m.embedding_dim)
    return out


def swap_quantized(module: nn.Module, layers: dict[str, QuantLayer], dtypes: dict, compute_dtype) -> nn.Module:
    """Replace, in place, each nn.Linear / nn.Embedding of `module` named in `layers` by its packed
    form (on the meta device, for load_weights to fill). Returns `module`."""
    for prefix, layer in layers.items():
        owner, _, leaf = prefix.rpartition(".")
        parent = module.get_submodule(owner) if owner else module
        cls = QuantEmbedding if isinstance(getattr(parent, leaf), nn.Embedding) else QuantLinear
        setattr(parent, leaf, cls(layer, dtypes, compute_dtype, device="meta"))
    return module


def on_load_prefixes(module: nn.Module) -> list[str]:
    """The linears `--target-bits 4` / `--drafter-bits 4` quantize: every nn.Linear whose input size is
    a multiple of the group (64), except the lm_head (kept in the stored dtype: its logits choose every
    token, and it is the target's and the drafter's both)."""
    return [name for name, m in module.named_modules()
            if isinstance(m, nn.Linear) and name != "lm_head" and m.in_features % ON_LOAD_GROUP == 0]


def _on_load_layer(prefix: str, lin: nn.Linear) -> QuantLayer:
    """The MLX 4-bit layer, group 64, quantize on load makes of the float linear `prefix`: the keys
    an MLX-written checkpoint stores it under (`X.weight` packed, `X.scales`, `X.biases`)."""
    return QuantLayer(prefix, lin.out_features, lin.in_features, QuantFormat(MLX, 4, ON_LOAD_GROUP),
                      {"packed": f"{prefix}.weight", "scales": f"{prefix}.scales", "biases": f"{prefix}.biases"})


def quantize_on_load(module: nn.Module, checkpoint_dtype: torch.dtype | None = None) -> list[str]:
    """Affine 4-bit, group 64 (dflash_iree/quant.py `quantize_affine`, MLX layout) of the float linears
    `on_load_prefixes` names, in place, from their loaded weights: the eager side of quantize on load.
    Scales and biases are kept in `checkpoint_dtype` (default the weight's). Returns the prefixes."""
    import numpy as np

    from dflash_iree.manifest import numpy_dtype

    prefixes = on_load_prefixes(module)
    for prefix in prefixes:
        owner, _, leaf = prefix.rpartition(".")
        parent = module.get_submodule(owner) if owner else module
        lin = getattr(parent, leaf)
        w = lin.weight.detach()
        sdtype = checkpoint_dtype or w.dtype
        name = {torch.bfloat16: "bf16", torch.float16: "f16", torch.float32: "f32"}[sdtype]
        packed, scales, biases = quantize_affine(w.float().numpy().astype(numpy_dtype(name)), ON_LOAD_GROUP)
        layer = _on_load_layer(prefix, lin)
        q = QuantLinear(layer, {layer.keys["scales"]: sdtype, layer.keys["biases"]: sdtype}, w.dtype)
        q.weight.data = torch.from_numpy(packed.view(np.int32).copy())
        q.scales.data = torch.from_numpy(scales.astype(np.float32)).to(sdtype)
        q.biases.data = torch.from_numpy(biases.astype(np.float32)).to(sdtype)
        setattr(parent, leaf, q)
    return prefixes


def swap_on_load(module: nn.Module, checkpoint_dtype: torch.dtype, compute_dtype: torch.dtype) -> list[str]:
    """The export side of quantize on load (`dflash-iree compile --target-bits 4`): swap, in place,
    the (meta) module's linears `on_load_prefixes` names for `QuantLinear`s on the meta device, as
    `swap_quantized` does for an MLX-written checkpoint of the same geometry: parameters `X.weight`
    int32 [N, K / 8] (bound as MLX's u32 words), `X.scales` and `X.biases` [N, K / 64] in
    `checkpoint_dtype` (the scales' dtype quantize_on_load keeps). The runtime makes those tensors
    from the float checkpoint as it binds them (runtime/quantize_on_load.py). Returns the prefixes."""
    prefixes = on_load_prefixes(module)
    layers = {prefix: _on_load_layer(prefix, module.get_submodule(prefix)) for prefix in prefixes}
    dtypes = {layer.keys[role]: checkpoint_dtype for layer in layers.values() for role in ("scales", "biases")}
    swap_quantized(module, layers, dtypes, compute_dtype)
    return prefixes


__all__ = ["CT", "MLX", "QuantLinear", "QuantEmbedding", "dequantize", "float_shapes", "on_load_prefixes",
           "quantize_on_load", "swap_on_load", "swap_quantized", "unpack"]
