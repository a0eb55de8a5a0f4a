"""`dflash-iree compile`: export the pair, lower it with iree-compile, write `compiled/ARCH/`.

Three steps, each usable alone (the measurement script and the tests export once and lower for
several archs):
- `plan()` reads and checks the two config.json files and the options; it raises `DFlashError`
  before anything is written;
- `export_mlir()` builds the modules on the meta device and exports them (export/aot.py);
- `lower()` lowers the export's named ops for one arch (dflash_iree/arch.py) in a copy of the
  export (export/splice.py: the arch's kernels, or IREE's own ops where the arch's rules say so),
  runs iree-compile (export/iree_tool.py) and writes `dflash.vmfb` and `manifest.json`
  (dflash_iree/manifest.py) into a temporary folder beside the destination, then renames it into
  place, so an interrupted compile leaves no half artifact (export/out_folder.py, which also
  refuses an `--out` that is not an earlier artifact folder).
"""

from __future__ import annotations

import hashlib
import importlib
import json
import os
import shutil
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path

from dflash_iree import guard
# ARCHS, ALIASES, GPU_OPT, RECORD_HOST_FLAGS, resolve_arch, compile_flags and the iree-compile runner
# are read from here too (tests, bench).
from dflash_iree.arch import (ALIASES, ARCHS, GPU_OPT, RECORD_HOST_FLAGS, Arch, compile_flags,  # noqa: F401
                              kernel_archs, resolve_arch)
from dflash_iree.cache import cache_dir  # where exported MLIR is kept between compiles (read from here too)
from dflash_iree.checkpoint import sha256_file
from dflash_iree.config import DrafterConfig, TargetConfig, config_hash, load_drafter_config, load_target_config
from dflash_iree.errors import DFlashError
from dflash_iree.guard import DFlashWarning
from dflash_iree.export import hybrid, out_folder
from dflash_iree.export.iree_tool import iree_compile_tool, run_iree_compile, scheduling_stats
from dflash_iree.export.splice import splice_file
from dflash_iree.manifest import COMPUTE_DTYPES, FORMAT_VERSION, KV_PAGE, MANIFEST_FILE, MODULE_FILE, Manifest  # noqa: F401

DEFAULT_CONTEXT = 4096
# `pages` is a dynamic dim 1..max_context / KV_PAGE (export/entry_points.py ExportShapes.dims), and
# torch.export.Dim refuses min == max ("inconsistent min=1, max=1"): at least two pages of 32 rows
MIN_CONTEXT = 64
DEFAULT_DRAFT_TOP_K = 8  # K of the draft_topk entry point; 0 compiles none


@dataclass
class Plan:
    """Checked inputs of one compile."""

    target: TargetConfig
    drafter: DrafterConfig
    block_size: int
    max_context: int
    dtype: str
    streams: int
    sampled: bool = True
    draft_top_k: int = DEFAULT_DRAFT_TOP_K
    attention: str = "fused"  # the arch's attention form (Arch.attention)
    prefill_chunk: int = 0  # prefill's static rows (a hybrid target, export/hybrid.py); 0: dynamic
    decode_steps: int = 0  # k of the `decode_steps` entry point (plain steps a call); 0: none
    entries: list = field(default_factory=list)  # filled by export_mlir
    parameters: dict = field(default_factory=dict)  # scope -> key -> {shape, dtype}
    state: dict = field(default_factory=dict)  # module-initialized globals (the caches)
    export_s: float = 0.0
    export_reused: bool = False  # the MLIR came from the export cache
    quantization: dict = field(default_factory=dict)  # scope -> dflash_iree.quant.QuantFormat or None
    quant_records: dict = field(default_factory=dict)  # scope -> the manifest's quantization entry (export)


MAX_STREAMS = 64  # each stream is a whole KV cache slot (S x max_context rows); more is a memory mistake
MAX_DECODE_STEPS = 16  # each step is a whole decode graph in the module: compile time grows with k

def plan(target_dir: str | Path, drafter_dir: str | Path, block_size: int | None = None,
         max_context: int | None = None, dtype: str | None = None, streams: int = 1, sampled: bool = True,
         draft_top_k: int = DEFAULT_DRAFT_TOP_K, attention: str = "fused", *,
         target_bits: int | None = None, drafter_bits: int | None = None, decode_steps: int = 0,
         arch: Arch | None = None) -> Plan:
    """Read and check the two config.json files and the options. Reads no weights, writes nothing.
    Warns (DFlashWarning) of a `dtype` other than the target's only once every check has passed, so
    a refused compile prints its refusal alone.

    streams: the leading stream dimension S of every entry point and cache, 1..MAX_STREAMS: the
    requests a module serves in one round (runtime/batch.py); S > 1 adds the per-stream prefill
    (export/stream_entry_points.py).

    draft_top_k: K of the `draft_topk` entry point (the draft's top-K ids and log-probs), 1..64 and
    at most the vocabulary; 0 compiles no such entry point.
    attention: the attention form to export, the target arch's `Arch.attention`.
    decode_steps: k of the `decode_steps` entry point (k plain decode steps in one call, each
        step's token fed to the next on the device), 2..MAX_DECODE_STEPS; 0 or 1 compiles none. One
        stream, dense (Qwen3) targets only: steps past a stop are rolled back by length, which a
        recurrent state cannot be.
    target_bits, drafter_bits: 4 to quantize that float checkpoint on load (dflash_iree/quant.py
        `on_load_format`: MLX affine, group 64): the module takes its linears as an MLX-written
        checkpoint's packed operands, and the runtime quantizes the float tensors as it binds them
        (runtime/quantize_on_load.py). A 4-bit MLX or compressed-tensors checkpoint is read as its
        config.json says. Either way `Plan.quantization`.
    arch: the arch compiled for, to refuse 4-bit weights it cannot take here (`_refuse_4bit_arch`,
        which reads a 4-bit checkpoint's safetensors headers), before the dtype warning; None
        leaves that to `lower`.

    Raises:
        DFlashError: a missing config, an unsupported family, a drafter that does not fit the
            target, block_size / max_context / dtype / streams / draft_top_k
            / decode_steps (with streams above 1 or a hybrid target: above 1) out of range, a bits
            option other than 4, or given for a checkpoint that is already 4-bit or for a hybrid
            target, a 4-bit format dflash_iree/quant.py refuses, a GGUF folder, a 4-bit hybrid target,
            or 4-bit weights `arch` cannot take.
    """
    from dflash_iree.kernels.topk import MAX_K

    tcfg = load_target_config(target_dir)
    dcfg = load_drafter_config(drafter_dir, tcfg)
    formats = _check_4bit(tcfg, dcfg, target_bits, drafter_bits)
    block = dcfg.block(block_size, "--block-size")
    limit, limit_why = tcfg.context_limit()
    if max_context is None:  # 4096, or less when the target was trained on less (vLLM's max_model_len default)
        max_context = min(DEFAULT_CONTEXT, limit - limit % KV_PAGE)
    if not MIN_CONTEXT <= max_context <= limit or max_context % KV_PAGE:
        raise DFlashError(f"--max-context {max_context} is out of range: use a multiple of {KV_PAGE} from "
                          f"{MIN_CONTEXT} to {limit} ({limit_why})")
    dtype = dtype or tcfg.dtype
    if dtype not in COMPUTE_DTYPES:
        raise DFlashError(f"--dtype {dtype} is not supported; use bf16, f16 or f32")
    if not 1 <= streams <= MAX_STREAMS:
        raise DFlashError(f"--streams {streams} is out of range: use 1..{MAX_STREAMS} (the requests served in one "
                          "round; every KV cache holds one slot per stream)")
    most = min(MAX_K, tcfg.vocab_size)
    if not 0 <= draft_top_k <= most:
        raise DFlashError(f"--draft-top-k {draft_top_k} is out of range: use 1..{most} (the top-K kernel's limit, "
                          "and at most the vocabulary), or 0 for no draft_topk entry point")
    if not 0 <= decode_steps <= MAX_DECODE_STEPS:
        raise DFlashError(f"--decode-steps {decode_steps} is out of range: use 2..{MAX_DECODE_STEPS} (plain decode "
                          "steps in one call), or 0 for none")
    if decode_steps > 1 and (streams > 1 or hybrid.is_hybrid(tcfg)):
        raise DFlashError(f"--decode-steps {decode_steps}: several decode steps in one call need one stream and a "
                          "dense target (steps past a stop roll back by length); leave --decode-steps out")
    p = Plan(tcfg, dcfg, block, max_context, dtype, streams, sampled, draft_top_k, attention,
             prefill_chunk=hybrid.prefill_chunk(tcfg), quantization=formats,
             decode_steps=decode_steps if decode_steps > 1 else 0)
    if arch is not None:
        _refuse_4bit_arch(p, arch)
    if dtype != tcfg.dtype:
        warnings.warn(f"--dtype {dtype}: the target's config.json says {tcfg.dtype}, and the runtime binds a "
                      f"checkpoint's tensors as stored, so these artifacts need {dtype} checkpoints of this config "
                      f"(convert them, or compile with --dtype {tcfg.dtype}, the default)", DFlashWarning, stacklevel=2)
    return p


def _check_4bit(tcfg: TargetConfig, dcfg: DrafterConfig, target_bits, drafter_bits) -> dict:
    """The 4-bit formats of the two checkpoints (scope -> QuantFormat or None), checked for compiling.

    A 4-bit MLX or compressed-tensors checkpoint compiles: its packed tensors are module parameters
    bound from the safetensors as stored, dequantized in the graph (export/quantized.py). A float
    checkpoint with `--SCOPE-bits 4` compiles as an MLX-written one of its geometry would
    (`quant.on_load_format`), the runtime quantizing its tensors as it binds them. Refused, one line
    each: bits other than 4, bits for a checkpoint already 4-bit (as the eager loader refuses
    them), bits for a Qwen3.5-family hybrid target, and a 4-bit hybrid target.
    """
    from dflash_iree import quant

    formats = {}
    for scope, cfg, bits in (("target", tcfg, target_bits), ("drafter", dcfg, drafter_bits)):
        option = f"--{scope}-bits"
        on_load = quant.check_bits(bits, option) is not None
        if on_load and scope == "target" and hybrid.is_hybrid(tcfg):
            raise DFlashError(f"{tcfg.folder}/config.json: {option} is not implemented for {tcfg.family} "
                              "(Qwen3.5-family) targets yet; leave it out")
        config = Path(cfg.folder) / "config.json"
        formats[scope] = quant.read_format(cfg.raw, config)
        if on_load and formats[scope] is not None:
            raise DFlashError(f"{option} {bits}: the {scope} checkpoint {cfg.folder} is already 4-bit "
                              f"({formats[scope].method}); leave {option} out")
        if on_load:
            formats[scope] = quant.on_load_format(str(config))
    if formats["target"] is not None and hybrid.is_hybrid(tcfg):
        raise DFlashError(f"{tcfg.folder}: 4-bit {tcfg.family} (Qwen3.5-family) targets are not compiled yet; "
                          "compile a bf16 checkpoint of it")
    return formats


def _refuse_4bit_arch(p: "Plan", arch: Arch) -> None:
    """4-bit weights compile for the host (IREE's own dequantize + matmul) and for the GPU archs of
    the skinny GEMM, whose 4-bit form dequantizes in registers (kernels/gemm, issue #28) and takes
    bf16 activations, scales and biases (quantize on load keeps them in the checkpoint's dtype).
    Anything else would leave a dispatch writing every dequantized weight, so it is refused in one line."""
    quantized = [s for s, f in p.quantization.items() if f is not None]
    if not quantized or arch.driver == "local-task":
        return
    what = " and ".join(quantized)
    if not arch.has("gemm"):
        on_load = [f"--{s}-bits" for s in quantized if p.quantization[s].on_load]
        fix = (f"leave {' and '.join(on_load)} out for this arch" if on_load
               else "compile a bf16 checkpoint for this arch")
        raise DFlashError(f"--arch {arch.name}: 4-bit {what} weights need the packed-weight GEMM kernel "
                          f"(kernels/gemm), which {arch.name} has none of; compile them for --arch host or an arch "
                          f"with the kernel ({', '.join(kernel_archs('gemm', 'cuda') + kernel_archs('gemm', 'hip'))}), "
                          f"or {fix}")
    if p.dtype != "bf16":
        raise DFlashError(f"--dtype {p.dtype}: 4-bit {what} weights on {arch.name} compute in bf16 (the packed-weight "
                          "GEMM's activations); pass --dtype bf16, or compile for --arch host")
    from dflash_iree.checkpoint import index_checkpoint

    for scope in quantized:
        cfg = getattr(p, scope)
        folder = cfg.folder
        if p.quantization[scope].on_load:
            if cfg.dtype != "bf16":
                raise DFlashError(f"--{scope}-bits 4: the {scope} checkpoint {folder} is {cfg.dtype}, and quantize on "
                                  f"load keeps scales and biases in it; the packed-weight GEMM on {arch.name} reads bf16 "
                                  "ones: quantize from a bf16 checkpoint, or compile it for --arch host")
            continue
        for key, info in sorted(index_checkpoint(folder).items()):
            if key.endswith((".scales", ".biases", ".weight_scale")) and info.dtype != "bf16":
                raise DFlashError(f"{folder}: {key} is {info.dtype}; the packed-weight GEMM on {arch.name} reads bf16 "
                                  "scales and biases: quantize the checkpoint from bf16 weights, or compile it for "
                                  "--arch host")


def quant_note(p: Plan) -> str | None:
    """The compile log's one line on 4-bit weights (None: both scopes float): each 4-bit scope's
    format and group size, with or without zero points (compressed-tensors), and whether the
    checkpoint stores it packed or the runtime quantizes a float one as it binds it (--SCOPE-bits 4)."""
    from dflash_iree.quant import CT

    parts = []
    for scope, f in p.quantization.items():
        if f is None:
            continue
        zeros = ("" if f.method != CT else ", symmetric" if f.symmetric else ", with zero points")
        how = (f"quantized on load from the float checkpoint by the runtime (--{scope}-bits 4)" if f.on_load
               else "packed in the checkpoint")
        parts.append(f"{scope} {f.method}, group {f.group_size}{zeros}, {how}")
    return "4-bit: " + "; ".join(parts) if parts else None


class Progress:
    """Progress lines with the seconds elapsed since the start."""

    def __init__(self, out=None):
        self.t0 = time.perf_counter()
        self.out = out

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def __call__(self, msg: str) -> None:
        print(f"[{self.elapsed():7.1f}s] {msg}", file=self.out or sys.stdout, flush=True)


def _build_pair(p: Plan):
    from dflash_iree.export import aot
    from dflash_iree.export.load import torch_dtype

    on_load = [scope for scope, f in p.quantization.items() if f is not None and f.on_load]
    return aot.build_pair(p.target, p.drafter, p.max_context, p.block_size, p.streams, torch_dtype(p.dtype),
                          p.draft_top_k, p.attention, on_load=on_load)


def _describe(p: Plan, pair) -> None:
    """Fill the plan's entry points, parameter table and module state from the (meta) pair."""
    from dflash_iree.export import aot
    from dflash_iree.export.load import quant_record

    p.entries = aot.entry_points(aot.export_shapes(p), p.sampled)
    p.parameters = aot.parameter_table(pair)
    p.quant_records = {scope: quant_record(module, p.quantization.get(scope)) for scope, module in
                       (("target", pair.target), ("drafter", pair.drafter))}
    for scope, record in p.quant_records.items():
        if record is not None and p.quantization[scope].on_load:
            record["on_load"] = _on_load_record(getattr(p, scope))
    p.state = {name: {"shape": list(b.shape), "dtype": aot.DTYPE_NAMES[b.dtype], "bytes": b.numel() * b.element_size()}
               for name, b in aot.state_globals(pair).items()}


def _on_load_record(cfg) -> dict:
    """The manifest's `quantization.on_load` of a scope quantized on load: where its packed operands
    come from (the float checkpoint, quantized by the runtime as it binds it), the rule's version
    (quant.ON_LOAD_RULE), the dtype of its scales and biases (the config's), and the source's
    identity for provenance: each safetensors file's bytes and sha256 (compile reads it once for
    this). The runtime binds any float checkpoint of the recorded shapes, as for float artifacts."""
    from dflash_iree.checkpoint import weight_files
    from dflash_iree.quant import ON_LOAD_RULE

    files = {f.name: {"bytes": f.stat().st_size, "sha256": sha256_file(f)} for f in weight_files(cfg.folder)}
    return {"from": "float checkpoint", "rule": ON_LOAD_RULE, "scale_dtype": cfg.dtype, "source": {"files": files}}


def export_mlir(p: Plan, path: str | Path, log=None) -> Path:
    """Export the pair described by `p` to MLIR at `path` (.mlirbc: bytecode); fills p.entries etc.
    Returns `path`."""
    import torch

    from dflash_iree.export import aot

    log = log or Progress()
    t0 = time.perf_counter()
    pair = _build_pair(p)
    _describe(p, pair)
    with torch.no_grad():
        output, _ = aot.export_module(pair, aot.export_shapes(p), p.sampled, log=log)
    output.save_mlir(path)
    p.export_s = time.perf_counter() - t0
    log(f"export: done in {p.export_s:.1f}s, MLIR {Path(path).stat().st_size / 2**20:.1f} MiB")
    return Path(path)


# What the export reads besides torch and the configs (keys of the export cache): every export/ file
# (a list of names went stale: dflash2.py and draft_window.py were missing from it, and a cached
# export outlived their edits), and the shared modules whose values it bakes in (shapes and page
# size, dtype names, config parsing).
_SHARED_SOURCES = ("config", "config_qwen35", "rope", "dflash2", "quant", "manifest")  # dflash_iree modules


def export_key(p: Plan) -> str:
    """sha256 of everything the exported MLIR depends on: the model shapes and options, the export
    sources, and the torch / iree-turbine / compiler versions (not the checkpoint folders)."""
    here = Path(__file__).parent
    sources = sorted(here.glob("*.py"))
    sources += [Path(importlib.import_module(f"dflash_iree.{m}").__file__) for m in _SHARED_SOURCES]
    parts = {
        "target": {k: v for k, v in p.target.to_dict().items() if k != "folder"},
        "drafter": {k: v for k, v in p.drafter.to_dict().items() if k != "folder"},
        "options": [p.block_size, p.max_context, p.dtype, p.streams, p.sampled, p.draft_top_k, p.attention,
                    p.prefill_chunk] + ([p.decode_steps] if p.decode_steps else []),
        # the packed layers' names, dtypes and shapes are the module's parameters: a 4-bit and a bf16
        # checkpoint of one config export differently, as do two group sizes or formats
        "quantization": {s: (f.to_dict() if f else None) for s, f in p.quantization.items()},
        # quantize on load packs fewer layers than an MLX-written checkpoint (not the embedding or
        # lm_head): another module from the same format
        "on_load": sorted(s for s, f in p.quantization.items() if f is not None and f.on_load),
        "quantized_tensors": _quantized_tensors(p),
        "versions": [_version(d) for d in ("torch", "iree-turbine", "iree-base-compiler")],
        "sources": [hashlib.sha256(f.read_bytes()).hexdigest() for f in sources],
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()


def _quantized_tensors(p: Plan) -> dict:
    """scope -> sorted (key, dtype, shape) of a 4-bit checkpoint's tensors (headers only; {} for float
    checkpoints): which layers a format left unquantized and the scales' dtype are in the export."""
    from dflash_iree.checkpoint import index_checkpoint

    out = {}
    for scope, cfg in (("target", p.target), ("drafter", p.drafter)):
        if p.quantization.get(scope) is not None and not p.quantization[scope].on_load:
            out[scope] = sorted((k, i.dtype, list(i.shape)) for k, i in index_checkpoint(cfg.folder).items())
    return out


def export_cached(p: Plan, work: Path, log=None, use_cache: bool = True) -> Path:
    """The exported MLIR for `p`: from the cache when an identical export is there, else exported
    now (into the cache when there is one, else into `work`). Fills p.entries etc. either way."""
    log = log or Progress()
    where = cache_dir() if use_cache else None
    if where is None:
        return export_mlir(p, work / "dflash.mlirbc", log)
    path = where / f"{export_key(p)}.mlirbc"
    if path.is_file():
        _describe(p, _build_pair(p))
        p.export_reused = True
        log(f"export: reusing {path} (same shapes, options, export sources and versions)")
        return path
    where.mkdir(parents=True, exist_ok=True)
    partial = where / f".{path.stem}.{os.getpid()}.mlirbc"  # renamed into place when whole
    try:
        export_mlir(p, partial, log)
        partial.replace(path)
        log(f"export: kept as {path} for the next compile of these shapes")
    finally:
        partial.unlink(missing_ok=True)
    return path


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def _config_entry(cfg, out: Path, quantization: dict | None = None) -> dict:
    """A checkpoint's manifest entry. Its folder twice: `folder` absolute, and `folder_relative` to the
    artifact folder `out`, so that artifacts moved together with their checkpoints still find them
    (runtime/artifacts.py `recorded_folder`; none where no relative path exists, another drive)."""
    folder = Path(cfg.folder).resolve()
    entry = {"folder": str(folder)}
    try:
        entry["folder_relative"] = os.path.relpath(folder, out.resolve())
    except ValueError:
        pass
    return {**entry, "config_hash": config_hash(cfg.raw), "config": cfg.to_dict(), "raw_config": cfg.raw,
            "quantization": quantization}


def manifest(p: Plan, arch: Arch, flags: list[str], stats: dict, files: dict, requested: str, note: str,
             compile_s: float, splice_flags: list[str] = (), splices: dict | None = None, *, out: Path) -> Manifest:
    """The manifest (dflash_iree/manifest.py; README, "manifest.json") of the artifact folder `out`."""
    from dflash_iree.export.aot import export_shapes, shapes_dict

    shapes = export_shapes(p)
    return Manifest(
        arch=arch.name,
        arch_requested=requested,
        arch_note=note,
        driver=arch.driver,
        module=MODULE_FILE,
        versions={"iree_base_compiler": _version("iree-base-compiler"), "torch": _version("torch"),
                  "iree_turbine": _version("iree-turbine"), "dflash_iree": _version("dflash-iree")},
        flags=flags,
        splice_flags=list(splice_flags),
        splices=splices or {},  # what export/splice.py replaced, and its rules (splice_file's report)
        target=_config_entry(p.target, out, p.quant_records.get("target")),
        drafter=_config_entry(p.drafter, out, p.quant_records.get("drafter")),
        block_size=p.block_size,
        trained_block_size=p.drafter.block_size,
        draft_top_k=p.draft_top_k,
        attention=p.attention,
        max_context=p.max_context,
        dtype=p.dtype,
        streams=p.streams,
        kv_page=KV_PAGE,
        tap_layer_ids=list(p.drafter.target_layer_ids),
        mask_token_id=p.drafter.mask_token_id,
        shapes=shapes_dict(shapes),
        entry_points=[e.to_dict() for e in p.entries],
        parameters=p.parameters,
        state=hybrid.state_record(p.state, p.target, p.block_size),
        stats={**stats, "export_s": round(p.export_s, 1), "export_reused": p.export_reused,
               "compile_s": round(compile_s, 1)},
        files=files,
    )


def lower(p: Plan, arch_name: str, mlir: str | Path, out_dir: str | Path, log=None, record: bool = False,
          dump_phases: str | Path | None = None, splices: dict | None = None) -> Manifest:
    """Lower the named ops for the arch in a copy of the exported MLIR (export/splice.py), then
    compile it for that arch into `out_dir` (written whole, or not at all).

    Args:
        p: the plan `export_mlir` filled.
        arch_name: an ARCH name or alias.
        mlir: the exported module.
        out_dir: destination folder; an existing one is replaced only if it holds nothing but a
            manifest.json and the files it lists (DFlashError otherwise, before anything is written).
        record: compile host for the fixed record CPU (RECORD_HOST_FLAGS).
        dump_phases: also write every compilation phase's IR there (the HAL IR is `*.hal.mlir`);
            the module is the same.
        splices: name -> lowering, in place of export/splice.py's LOWERINGS (a compile experiment).

    Returns:
        The manifest (also written to `out_dir`/manifest.json).
    """
    log = log or Progress()
    arch, note = resolve_arch(arch_name)
    _refuse_4bit_arch(p, arch)
    out = Path(out_dir)
    out_folder.check_destination(out)
    flags = compile_flags(arch, record)
    stage = out_folder.stage_beside(out)
    try:
        vmfb = stage / MODULE_FILE
        stats_file = stage / "stats.csv"
        t0 = time.perf_counter()
        source, splice_flags, replaced = splice_file(mlir, stage / "spliced.mlirbc", arch.name, splices)
        if source != Path(mlir):
            log(f"splice: custom dispatches for {arch.name} in {time.perf_counter() - t0:.1f}s")
        log(f"compile: iree-compile for {arch.name} ({arch.about}) ...")
        extra = [f"--dump-compilation-phases-to={dump_phases}"] if dump_phases else []
        run_iree_compile(source, vmfb, flags, stats_file, [*splice_flags, *extra])
        compile_s = time.perf_counter() - t0
        stats = scheduling_stats(stats_file)
        stats_file.unlink()
        if source != Path(mlir):
            source.unlink()
        log(f"compile: {arch.name} done in {compile_s:.1f}s: {vmfb.stat().st_size / 2**20:.2f} MiB, "
            f"{stats['executables']} executables, {stats['dispatches']} dispatches")
        files = {MODULE_FILE: sha256_file(vmfb)}
        stats["module_bytes"] = vmfb.stat().st_size
        m = manifest(p, arch, flags, stats, files, arch_name, note, compile_s, splice_flags, replaced, out=out)
        (stage / MANIFEST_FILE).write_text(m.dumps())
        out_folder.replace(stage, out)
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        raise
    return m


def compile_artifacts(arch: str, target_dir, drafter_dir, out_dir=None, block_size: int | None = None,
                      max_context: int | None = None, dtype: str | None = None, streams: int = 1, sampled: bool = True,
                      log=None, record: bool = False, use_cache: bool = True,
                      draft_top_k: int = DEFAULT_DRAFT_TOP_K, splices: dict | None = None,
                      attention: str | None = None, target_bits: int | None = None,
                      drafter_bits: int | None = None, decode_steps: int | None = None) -> Manifest:
    """The whole `dflash-iree compile`: plan, export (or reuse a cached export), lower (`splices` as
    there; `attention` in place of the arch's own form, a compile experiment; `decode_steps` None: the
    arch's `Arch.decode_steps` for a one-stream dense pair, else none). Returns the manifest."""
    log = log or Progress()
    resolved, note = resolve_arch(arch)
    if note:
        log(f"note: {note}")
    if (attention or resolved.attention) == "fused" and not resolved.has("norm_rope"):
        raise DFlashError(f"attention form 'fused' exports the q/k norm + rope custom op, which has a kernel on GPU "
                          f"archs only ({', '.join(kernel_archs('norm_rope'))}), not {resolved.name}: compile the 'matmul' form")
    if decode_steps is None:
        dense = not hybrid.is_hybrid(load_target_config(target_dir))
        decode_steps = resolved.decode_steps if streams == 1 and dense else 0
    # every refusal before plan's --dtype warning: a refused compile prints one line
    if out_dir is not None and not str(out_dir).strip():
        raise DFlashError("--out is empty; give a folder, or leave --out out for compiled/ARCH")
    out = Path(out_dir) if out_dir is not None else Path("compiled") / resolved.name
    out_folder.check_destination(out)
    iree_compile_tool()
    p = plan(target_dir, drafter_dir, block_size, max_context, dtype, streams, sampled, draft_top_k,
             attention or resolved.attention, target_bits=target_bits, drafter_bits=drafter_bits,
             decode_steps=decode_steps, arch=resolved)
    log(f"configs: target {p.target.num_hidden_layers} layers, hidden {p.target.hidden_size}, vocab "
        f"{p.target.vocab_size}; drafter {p.drafter.num_hidden_layers} layers, taps {list(p.drafter.target_layer_ids)}; "
        f"block {p.block_size}, max_context {p.max_context}, {p.dtype}, streams {p.streams}, draft top-K {p.draft_top_k}")
    note = quant_note(p)
    if note:
        log(note)
    with guard.out_lock(out), tempfile.TemporaryDirectory(prefix="dflash-export-") as work:
        mlir = export_cached(p, Path(work), log, use_cache)
        m = lower(p, arch, mlir, out, log, record, splices=splices)
    size = m.stats["module_bytes"] / 2**20
    export = "export reused" if p.export_reused else f"export {p.export_s:.0f}s"
    log(f"done: {out}/{MODULE_FILE} {size:.2f} MiB + {MANIFEST_FILE}, {m.stats['executables']} executables; "
        f"{export} + compile {m.stats['compile_s']:.0f}s = {log.elapsed():.0f}s total")
    return m
