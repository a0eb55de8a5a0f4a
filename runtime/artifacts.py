"""Compiled artifacts on disk: read the manifest, check them, open a device, bind the weights.

Checks made before any work, each with an error that names the file or field and the fix:
- the manifest is whole, of this format version and has every field (dflash_iree/guard.py,
  dflash_iree/manifest.py), and every file it lists exists, with the recorded size and sha256;
- the device's driver is the manifest's `driver` (an sm_89 module on `hip` is refused by name);
- each checkpoint's 4-bit format (or float weights) is the one the module was compiled for (one
  line naming both, `check_quantization`; a module compiled with --SCOPE-bits 4 takes a float one);
- every parameter key the module needs is in the checkpoint with the recorded shape and dtype,
  all problems listed at once, with the `--dtype` to compile with when only the dtype differs;
  then the checkpoints' parsed config fields that the graph computes with against the manifest's
  (guard.config_problems; a drafter trained for another block size only warns).
The module is mapped read-only, so a read-only artifact folder works.

Weights are bound straight from the HF safetensors files: one `iree.runtime.ParameterIndex` per
checkpoint (scopes `target` and `drafter`), memory-mapped, never copied through Python objects. A
4-bit checkpoint's packed tensors bind the same way, by key, as stored (MLX's uint32 words and
compressed-tensors' int32 words, their float scales and biases or int32 zero points): the module
dequantizes them in its graph (export/quantized.py). A scope compiled with `--target-bits 4` /
`--drafter-bits 4` binds its packed layers from tensors quantized from the float checkpoint, kept
in a cache file (runtime/quantize_on_load.py), and its other tensors from the checkpoint.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from dflash_iree import guard
from dflash_iree.checkpoint import index_checkpoint
from dflash_iree.config import is_drafter_config
from dflash_iree.errors import DFlashError
from dflash_iree.manifest import MANIFEST_FILE, Manifest, numpy_dtype

MAX_PROBLEM_LINES = 12  # a wrong checkpoint mismatches every parameter: the first lines say enough
DTYPE_HINT = "  the checkpoint holds"  # check_checkpoint's closing line when only dtypes differ


@dataclass
class Artifacts:
    """A compiled artifact folder: `manifest.json` plus the module it lists."""

    folder: Path
    manifest: Manifest

    @classmethod
    def load(cls, folder: str | Path, unchecked: tuple[str, ...] = ()) -> "Artifacts":
        """Read and check `folder/manifest.json` and the files it lists (but `unchecked`: calibrate
        replaces the cost file, whatever state it is in).

        Raises:
            DFlashError: a missing folder or manifest, a cut-off or non-JSON one (guard.read_manifest),
                another format version, a missing field or one the runtime cannot use
                (Manifest.from_json), a missing file, or a size or sha256 mismatch (guard.check_files).
        """
        folder = Path(folder)
        path = folder / MANIFEST_FILE
        data = guard.read_manifest(folder)  # whole, JSON, an object (a cut-off file is named)
        manifest = Manifest.from_json(data, path)
        guard.check_files(folder, {**data, "files": {k: v for k, v in data["files"].items() if k not in unchecked}}
                          if unchecked and isinstance(data.get("files"), dict) else data)
        return cls(folder, manifest)

    @property
    def arch(self) -> str:
        return self.manifest.arch

    @property
    def block_size(self) -> int:
        return int(self.manifest.block_size)

    @property
    def max_context(self) -> int:
        return int(self.manifest.max_context)

    @property
    def target_folder(self) -> str:
        """The target checkpoint folder the manifest records (`recorded_folder`)."""
        return str(self.recorded_folder("target"))

    @property
    def drafter_folder(self) -> str:
        """The drafter checkpoint folder the manifest records (`recorded_folder`)."""
        return str(self.recorded_folder("drafter"))

    def recorded_folder(self, scope: str) -> Path:
        """The checkpoint folder of `scope` ("target", "drafter") that the manifest records: its
        `folder_relative` against this artifact folder when that exists (artifacts moved together
        with their checkpoints), else its absolute `folder` (the only entry of manifests written
        before folder_relative; artifacts moved without their checkpoints). Not checked to exist."""
        entry = getattr(self.manifest, scope)
        if "folder_relative" in entry:
            near = self.folder / entry["folder_relative"]
            if near.is_dir():
                return near
        return Path(entry["folder"])

    def checkpoint_folder(self, scope: str, given: str | Path | None = None) -> Path:
        """The checkpoint folder to bind for `scope` ("target", "drafter"): `given`, or the
        recorded one (`recorded_folder`).

        Raises:
            DFlashError: the folder does not exist; the message names the option (--target,
                --drafter) and, for the recorded folder, the manifest fields it came from.
        """
        if given:
            if not Path(given).is_dir():
                raise DFlashError(f"{scope} checkpoint folder {given} (--{scope}) does not exist; pass the folder "
                                  f"that holds the {scope}'s config.json and safetensors")
            return Path(given)
        folder = self.recorded_folder(scope)
        if folder.is_dir():
            return folder
        entry = getattr(self.manifest, scope)
        where = f"{scope}.folder {entry['folder']}"
        if "folder_relative" in entry:
            where = (f"neither {scope}.folder_relative {entry['folder_relative']} (from {self.folder}: "
                     f"{self.folder / entry['folder_relative']}) nor {where}")
        raise DFlashError(f"the {scope} checkpoint recorded in {self.folder / 'manifest.json'} does not exist "
                          f"({where}); pass --{scope} DIR (Engine.load({scope}=DIR)), the checkpoint folder it was "
                          "compiled from")

    @property
    def eos_token_ids(self) -> list[int]:
        return self.manifest.eos_token_ids

    @property
    def vmfb(self) -> Path:
        return self.folder / self.manifest.module

    def source_parameters(self, scope: str) -> dict:
        """key -> {shape, dtype} of the tensors the `scope` checkpoint must hold: the manifest's
        parameter table, or, for a scope quantized on load, the float weights its packed layers are
        made from (runtime/quantize_on_load.py `source_parameters`; dtype a tuple: any float)."""
        from .quantize_on_load import on_load, source_parameters

        spec = on_load(self.manifest, scope)
        table = self.manifest.parameters[scope]
        return table if spec is None else source_parameters(table, spec)

    def check_checkpoint(self, scope: str, folder: str | Path) -> list[str]:
        """Problems between the module's `scope` parameters and the checkpoint at `folder` (empty: fits)."""
        index = index_checkpoint(folder)
        problems, only_dtype = [], True
        for key, want in self.source_parameters(scope).items():
            info = index.get(key)
            dtypes = want["dtype"] if isinstance(want["dtype"], tuple) else (want["dtype"],)
            if info is None:
                problems.append(f"  {scope} {key}: missing (expected {'/'.join(dtypes)} {want['shape']})")
                only_dtype = False
            elif list(info.shape) != list(want["shape"]):
                problems.append(f"  {scope} {key}: expected shape {want['shape']}, found {list(info.shape)} in {info.file.name}")
                only_dtype = False
            elif info.dtype not in dtypes:
                problems.append(f"  {scope} {key}: expected dtype {'/'.join(dtypes)}, found {info.dtype} in {info.file.name}")
        if problems and only_dtype:
            found = {i.dtype for i in index.values()}
            problems.append(f"{DTYPE_HINT} {'/'.join(sorted(found))} and the runtime binds its tensors as stored: "
                            f"recompile with --dtype {sorted(found)[0]}, or convert the checkpoints to "
                            f"{self.manifest.dtype}")
        return problems

    def check_quantization(self, scope: str, folder: str | Path) -> None:
        """The checkpoint's 4-bit format (its config.json, dflash_iree/quant.py) against the one the
        module was compiled for (the manifest's `SCOPE.quantization`; none: float weights; one
        quantized on load: float weights, which the runtime quantizes).

        Raises:
            DFlashError: one line, when they differ (a float checkpoint for a 4-bit module, a 4-bit
                one for float weights or for quantize on load, another format, group size or
                symmetry), naming both and the fix; or a format quant.py refuses.
        """
        import json

        from dflash_iree import quant

        path = Path(folder) / "config.json"
        try:
            raw = json.loads(path.read_text())
        except (OSError, ValueError):
            return  # config_problems names an unreadable config.json
        fmt = quant.read_format(raw, path) if isinstance(raw, dict) else None
        have = fmt.to_dict() if fmt else None
        recorded = (getattr(self.manifest, scope).get("quantization") or None)
        if recorded and recorded.get("on_load"):
            if have is not None:
                raise DFlashError(f"{scope} checkpoint {folder} holds {have['method']} {have['bits']}-bit weights but "
                                  f"{self.folder / MANIFEST_FILE} was compiled to quantize a float {scope} on load "
                                  f"(--{scope}-bits 4); pass the float {scope} checkpoint, or compile for this one: "
                                  f"dflash-iree compile --arch {self.arch} --{scope} {folder} (without --{scope}-bits)")
            return
        want = quant.format_fields(recorded) if recorded else None
        if have != want:
            def say(f):
                return "float weights" if f is None else (f"{f['method']} {f['bits']}-bit, group {f['group_size']}"
                                                          + ("" if f.get("symmetric", True) else ", asymmetric"))
            raise DFlashError(f"{scope} checkpoint {folder} holds {say(have)} but {self.folder / MANIFEST_FILE} was "
                              f"compiled for {say(want)}; pass the {scope} checkpoint it was compiled from, or compile for "
                              f"this one: dflash-iree compile --arch {self.arch} --{scope} {folder}")

    def bind(self, device, target: str | None = None, drafter: str | None = None, device_name: str | None = None):
        """Load the module on `device` with both checkpoints bound; returns a CompiledPair.

        Args:
            target, drafter: checkpoint folders; default the ones the manifest records
                (`checkpoint_folder`).
            device_name: the IREE name `device` was opened by ("cuda://1"; default the manifest's
                driver), for the free memory an out-of-memory error reports.

        Raises:
            DFlashError: a checkpoint folder that does not exist (naming --target / --drafter), or
                listing every missing or mismatched parameter of both checkpoints.
        """
        import iree.runtime as rt

        folders, missing = {}, []
        for scope, given in (("target", target), ("drafter", drafter)):
            try:
                folders[scope] = self.checkpoint_folder(scope, given)
            except DFlashError as e:  # both missing folders in one message, not one per try
                missing.append(str(e))
        if missing:
            raise DFlashError("\n".join(missing))
        target, drafter = folders["target"], folders["drafter"]
        _refuse_wrong_kind(target, drafter)
        for scope, folder in folders.items():
            self.check_quantization(scope, folder)
        problems = self.check_checkpoint("target", target) + self.check_checkpoint("drafter", drafter)
        problems = problems or guard.config_problems(self.manifest, target, drafter, self.folder)
        if problems:
            raise DFlashError(f"the checkpoints do not fit {self.folder}/manifest.json:\n" + _problem_lines(problems)
                              + _swapped_hint(self, target, drafter))
        from .quantize_on_load import on_load, parameter_index

        indexes = {}
        for scope, folder in (("target", target), ("drafter", drafter)):
            spec = on_load(self.manifest, scope)
            if spec is not None:  # its packed layers made from the float checkpoint (or their cache)
                indexes[scope] = parameter_index(rt, folder, spec, self.manifest.parameters[scope], scope)
                continue
            indexes[scope] = rt.ParameterIndex()
            for path in sorted({i.file for i in index_checkpoint(folder).values()}):
                indexes[scope].load(str(path))  # memory-mapped
        return self.bind_indexes(device, indexes, device_name)

    def bind_indexes(self, device, indexes: dict, device_name: str | None = None):
        """Load the module on `device` with parameters from prepared `iree.runtime.ParameterIndex`es.

        Args:
            indexes: scope ("target", "drafter") -> ParameterIndex holding every key of that scope
                (e.g. `add_buffer` of weights made in memory, as bench/speed_8b.py does). Unchecked:
                a missing key fails when the module loads.
            device_name: as for `bind`.

        Returns:
            A CompiledPair, whose `fn` calls check the buffers they write against the manifest
            (module.py EntryCall).
        """
        import iree.runtime as rt

        from .module import CompiledPair, EntryCall

        instance = rt.VmInstance()
        providers = [indexes[scope].create_provider(scope=scope) for scope in ("target", "drafter")]
        vm_module = _map_module(rt, instance, self.vmfb)
        try:
            context = rt.VmContext(instance, modules=[rt.create_hal_module(instance, device),
                                                      rt.create_io_parameters_module(instance, *providers), vm_module])
        except RuntimeError as e:  # the module's initializer allocates the KV caches
            if "RESOURCE_EXHAUSTED" in str(e):
                raise guard.out_of_memory(self.manifest, self.folder, device_name or self.manifest.driver, str(e)) from None
            raise
        functions = {e["name"]: EntryCall(rt.FunctionInvoker(context, device, vm_module.lookup_function(e["name"])), e)
                     for e in self.manifest.entry_points}
        shapes = self.manifest.shapes
        pair = CompiledPair(device, functions, self.block_size, shapes["kv_page"], shapes["tap_width"],
                            numpy_dtype(self.manifest.dtype), context, vm_module, int(self.manifest.draft_top_k),
                            int(shapes.get("prefill_chunk", 0)), int(shapes.get("decode_steps", 0)))
        pair._keep = (instance, context, vm_module)  # the functions need these alive
        return pair


def open_device(arts: Artifacts, name: str | None = None):
    """The IREE device for `arts`: `name` ("cuda", "cuda://1", "hip", "local-task") or the manifest's driver.

    Raises:
        DFlashError: the device's driver is not the manifest's `driver` (local-sync and local-task
            both run a local-task module), or the device cannot be opened.
    """
    import iree.runtime as rt

    want = arts.manifest.driver
    name = name or want
    driver = name.split("://")[0]
    cpu = {"local-task", "local-sync"}
    if not (driver == want or (driver in cpu and want in cpu)):
        raise DFlashError(f"{arts.folder} was compiled for {arts.arch}, which runs on the '{want}' driver, not on "
                          f"'{name}'; use --device {want} or compile for this device's arch")
    try:
        return rt.get_device(name)
    except Exception as e:  # the bindings raise ValueError / RuntimeError with driver messages
        raise DFlashError(f"cannot open IREE device '{name}': {e}") from None


def _map_module(rt, instance, path: Path):
    """The module file memory-mapped read-only: `VmModule.mmap` opens it for writing too, which
    fails in a read-only artifact folder (a shared install, a read-only mount)."""
    import mmap

    try:
        with open(path, "rb") as f:
            mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    except OSError as e:
        raise DFlashError(f"{path}: cannot read it ({e.strerror}); check its permissions") from None
    return rt.VmModule.wrap_buffer(instance, mapped, close_buffer=True)


def _problem_lines(problems: list[str]) -> str:
    """`check_checkpoint`'s lines: the first MAX_PROBLEM_LINES of the per-parameter ones, a count of
    the rest, then its closing hints (the dtype to recompile with) whole."""
    hints = list(dict.fromkeys(p for p in problems if p.startswith(DTYPE_HINT)))  # once for both checkpoints
    params = [p for p in problems if not p.startswith(DTYPE_HINT)]
    more = len(params) - MAX_PROBLEM_LINES
    return "\n".join(params[:MAX_PROBLEM_LINES] + ([f"  ... and {more} more"] if more > 0 else []) + hints)


def _refuse_wrong_kind(target: Path, drafter: Path) -> None:
    """One line when --target holds a DFlash drafter or --drafter a target, by their config.json
    (a folder without one is left to the parameter check).

    Raises:
        DFlashError: naming the folder (both, when they look swapped) and the fix.
    """
    import json

    def drafter_config(folder: Path, loose: bool) -> bool | None:
        # loose: a top-level mask_token_id counts too, as load_drafter_config reads one; not for
        # the target's folder, lest a target config that carries one look like a drafter
        try:
            raw = json.loads((folder / "config.json").read_text())
        except (OSError, ValueError):
            return None
        return is_drafter_config(raw) or (loose and "mask_token_id" in raw)

    t, d = drafter_config(target, loose=False), drafter_config(drafter, loose=True)
    if t is True and d is False:
        raise DFlashError(f"--target {target} holds a DFlash drafter and --drafter {drafter} a target "
                          "(their config.json): they look swapped; pass them the other way round")
    if d is False:
        raise DFlashError(f"--drafter {drafter}: its config.json is a target's, not a DFlash drafter's; "
                          "pass the drafter's folder")
    if t is True:
        raise DFlashError(f"--target {target}: its config.json is a DFlash drafter's; pass the target's folder")


def _swapped_hint(arts: Artifacts, target: Path, drafter: Path) -> str:
    """A line when the target folder fits the drafter's parameters and the drafter folder the target's."""
    if arts.check_checkpoint("drafter", target) or arts.check_checkpoint("target", drafter):
        return ""
    return "\n  the two folders fit the other way round: --target and --drafter look swapped"
