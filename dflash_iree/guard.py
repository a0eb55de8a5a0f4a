"""Files and machines read defensively: the artifact folder, the checkpoint configs, the compile
lock beside `--out`, and the device's memory.

Each check turns a fault that would otherwise surface as a traceback, a crash inside IREE or a
silently different model into one `DFlashError` line naming the file or field and the fix:
- `read_manifest` / `check_files`: `--artifacts` pointing at a file, a truncated or non-JSON
  manifest.json, a listed file that is missing, of another size, or of another sha256;
- `config_problems`: a checkpoint whose config.json differs from the manifest's in a field the
  compiled graph depends on (compared field by field, not by the raw config's hash, so one
  artifact serves every checkpoint of its config); a drafter trained for another block size
  only warns (`DFlashWarning`): the output stays exact, τ falls;
- `out_lock`: two compiles into one `--out` at once; the second refuses;
- `out_of_memory`: an IREE RESOURCE_EXHAUSTED as the bytes needed, the bytes free and a
  `--max-context` that would fit;
- `run_tool`: iree-compile killed with its children when the compile is interrupted.
Torch-free and IREE-free.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import re
import signal
import subprocess
import warnings
from contextlib import contextmanager
from pathlib import Path

from .checkpoint import sha256_file
from .config import load_drafter_config, load_target_config
from .errors import DFlashError
from .manifest import DEPTH_COST_FILE, DTYPES, FORMAT_VERSION, MANIFEST_FILE, Manifest

# The fields without which a format-2 manifest is not ours at all (read before anything else): one
# missing means the file was changed. A subset of Manifest's fields on purpose, not all of them:
# Manifest.from_json names the others, missing, as written by an older dflash-iree
# (tests/test_runtime.py); tests/test_guard.py keeps this a subset.
MANIFEST_FIELDS = ("format_version", "arch", "module", "files", "target", "drafter", "block_size", "max_context",
                   "dtype", "shapes", "entry_points", "parameters")
# fields of config.py's parsed configs that change what the compiled graph computes
LAYER_FIELDS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                "head_dim", "rms_norm_eps", "rope_theta", "yarn", "attention_bias", "vocab_size")
# fields an older manifest may lack, and what their absence means (compared all the same): a manifest
# written before YaRN was read was compiled with plain RoPE
ABSENT_MEANS = {"yarn": None}
TARGET_FIELDS = LAYER_FIELDS + ("tie_word_embeddings",)
DRAFTER_FIELDS = LAYER_FIELDS + ("mask_token_id", "target_layer_ids", "input_embedding_scale", "output_multiplier",
                                 "final_logit_softcapping", "dflash2")


class DFlashWarning(UserWarning):
    """Something that costs speed, not correctness (the CLI prints it as one line)."""


def read_manifest(folder: str | Path) -> dict:
    """`folder/manifest.json` as a dict, checked to be a whole manifest.

    Raises:
        DFlashError: `folder` is a file (the .vmfb given as --artifacts: names its folder), the
            manifest is missing, not JSON (a truncated file says so), not an object, or lacks a
            field the runtime needs.
    """
    folder = Path(folder)
    if folder.is_file():
        raise DFlashError(f"--artifacts {folder} is a file; pass the artifact folder that holds it and its "
                          f"{MANIFEST_FILE}: --artifacts {folder.parent}")
    path = folder / MANIFEST_FILE
    if not path.is_file() and (folder / "config.json").is_file():
        raise DFlashError(f"--artifacts {folder} is a checkpoint folder (it has config.json), not compiled artifacts; "
                          f"compile it first (dflash-iree compile --arch ARCH --target DIR --drafter DIR, into "
                          f"compiled/ARCH) and pass that folder as --artifacts")
    if not path.is_file():
        raise DFlashError(f"{path} does not exist; build the artifacts first: dflash-iree compile --arch ARCH "
                          f"--target DIR --drafter DIR --out {folder}")
    try:
        data = path.read_bytes()
        manifest = json.loads(data)
    except OSError as e:
        raise DFlashError(f"{path}: cannot read it ({e.strerror}); check the folder's permissions") from None
    except (ValueError, UnicodeDecodeError) as e:
        # The parser ran out of text: at the end, or inside a string (whose error points at its start;
        # strict JSON strings hold no raw newline, so an unterminated one reached the end of the file).
        pos, text = getattr(e, "pos", None) or 0, data.rstrip()
        end = (pos >= len(text) or str(getattr(e, "msg", "")).startswith("Unterminated string")
               # a literal or a number cut short ("f" of false, "-", "1e", "0."): the parser stops before it
               or any(word.startswith(text[pos:]) for word in (b"true", b"false", b"null", b"-"))
               or re.fullmatch(rb"[.eE][-+]?", text[pos:]) is not None)
        what = f"cut off after {len(data)} bytes" if end else f"not valid JSON ({e})"
        raise DFlashError(f"{path} is {what}; the compile that wrote it was interrupted or the file was changed: "
                          "recompile the artifacts") from None
    if not isinstance(manifest, dict):
        raise DFlashError(f"{path} is not a JSON object; recompile the artifacts")
    missing = [k for k in MANIFEST_FIELDS if k not in manifest]
    if missing and manifest.get("format_version") == FORMAT_VERSION:
        raise DFlashError(f"{path} lacks the field(s) {', '.join(missing)}; the file was changed: recompile the artifacts")
    return manifest


def check_files(folder: Path, manifest: dict) -> None:
    """Every file the manifest lists exists with the recorded size (the module's, `stats.module_bytes`)
    and sha256; the size first, so that a truncated file is named as such without hashing it.

    Raises:
        DFlashError: a missing file, another size, or another sha256, naming the file.
    """
    path = folder / MANIFEST_FILE
    files = manifest["files"]
    if not isinstance(files, dict):
        raise DFlashError(f"{path}: 'files' is not a name -> sha256 map; recompile the artifacts")
    sizes = {manifest["module"]: (manifest.get("stats") or {}).get("module_bytes")}
    for name, digest in files.items():
        f = folder / name
        # the cost file is measured, not compiled: its fix is calibrate's (runtime/depth.py)
        fix = f"measure it again: dflash-iree calibrate --artifacts {folder}" if name == DEPTH_COST_FILE else \
            "recompile the artifacts"
        if not f.is_file():
            raise DFlashError(f"{f} is missing (listed in {path}); {fix}")
        size, want = f.stat().st_size, sizes.get(name)
        if want is not None and size != want:
            raise DFlashError(f"{f} is {size} bytes, {path} records {want}: the file was cut off or changed; {fix}")
        try:
            same = sha256_file(f) == digest
        except OSError as e:
            raise DFlashError(f"{f}: cannot read it ({e.strerror}); check its permissions") from None
        if not same:
            raise DFlashError(f"{f}: sha256 differs from {path}; the file was changed or half written, "
                              + ("recompile" if name != DEPTH_COST_FILE else fix))


def _differences(scope: str, fields, recorded: dict, found: dict, folder: Path) -> list[str]:
    out = []
    for k in fields:
        want, got = recorded.get(k, ABSENT_MEANS.get(k)), found.get(k)
        if isinstance(want, list) or isinstance(got, (list, tuple)):
            want, got = list(want or []), list(got or [])
        if (k in recorded or k in ABSENT_MEANS) and want != got:
            out.append(f"  {scope} {k}: {got} in {folder}/config.json, {want} in the manifest")
    return out


def config_problems(manifest: Manifest, target: Path, drafter: Path, out: Path | None = None) -> list[str]:
    """Fields of the two checkpoints' config.json that differ from the configs the module was
    compiled for (the manifest's `target.config` / `drafter.config`), as problem lines (empty: fit).
    The compile command offered as the fix names resolved folders, and `--out` the artifact folder
    `out` when given, so that running it replaces these artifacts.

    A drafter trained for another block size is not a problem: the compiled graph still computes
    its model, verification keeps the output exact, and only τ falls; that warns (DFlashWarning)
    with the consequence and the fix.

    Raises:
        DFlashError: a config.json that is missing or unreadable (config.py's messages).
    """
    tcfg = load_target_config(target)
    dcfg = load_drafter_config(drafter, tcfg)
    t, d = tcfg.to_dict(), dcfg.to_dict()
    problems = _differences("target", TARGET_FIELDS, manifest.target["config"], t, target)
    problems += _differences("drafter", DRAFTER_FIELDS, manifest.drafter["config"], d, drafter)
    trained = manifest.trained_block_size
    recompile = (f"dflash-iree compile --arch {manifest.arch} --target {target.resolve()} --drafter {drafter.resolve()}"
                 + (f" --out {out.resolve()}" if out is not None else ""))
    if not problems and dcfg.block_size != trained:
        warnings.warn(
            f"drafter {drafter} was trained for block_size {dcfg.block_size}, these artifacts for a drafter trained "
            f"for {trained} (verify block {manifest.block_size}): the output is exact, but fewer drafts are "
            f"accepted (τ fell from 2.8 to 1.8 on the demo pair); for its full τ compile for it: {recompile}",
            DFlashWarning,
            stacklevel=3)
    if problems:
        problems.append(f"  the compiled graph computes the manifest's model; compile for these checkpoints: {recompile}")
    return problems


def lock_path(out: Path) -> Path:
    """The lock file of an artifact folder: beside it, in its parent (never inside it)."""
    return out.parent / f".{out.name}.lock"


@contextmanager
def out_lock(out: str | Path):
    """Hold the lock of `--out` for a compile (flock on `lock_path(out)`, removed afterwards).

    A lock a killed compile left behind is not held, so it is taken over; the file is checked to
    still be the one locked, so that a lock removed by its holder meanwhile is taken afresh.

    Raises:
        DFlashError: `out` or its parent is not writable, or another process holds the lock
            (naming its pid and the lock file).
    """
    out = Path(out)
    path = lock_path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    for folder in (path.parent, out) if out.is_dir() else (path.parent,):
        if not os.access(folder, os.W_OK):  # found before the export, not at the rename after the compile
            raise DFlashError(f"--out {out}: {folder} is not writable, and a compile writes a stage folder beside --out "
                              "and renames it into place; make it writable or choose another --out")
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            os.close(fd)
            if e.errno not in (errno.EAGAIN, errno.EACCES):
                raise
            try:
                pid = path.read_text().strip() or "?"
            except OSError:
                pid = "?"
            raise DFlashError(f"another dflash-iree compile (pid {pid}) is writing {out} (lock {path}); wait for it "
                              "to finish, or choose another --out") from None
        try:
            same = os.fstat(fd).st_ino == os.stat(path).st_ino
        except FileNotFoundError:
            same = False
        if same:
            break
        os.close(fd)  # the holder removed it between our open and flock: take the new one
    try:
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        yield path
    finally:
        path.unlink(missing_ok=True)
        os.close(fd)


def _available_bytes(device: str, sysfs: Path = Path("/sys")) -> int | None:
    """Bytes this process can still allocate on `device` (an IREE device name: "local-task",
    "cuda", "cuda://1", "hip://0"), or None where that cannot be told.

    local-task: the least of the host's MemAvailable, its cgroup's memory.max - memory.current, and
    its address-space limit (RLIMIT_AS) less its current size. cuda: nvidia-smi's memory.free of
    the GPU. hip: the amdgpu driver's mem_info_vram_total - mem_info_vram_used under `sysfs`
    (class/drm/cardN/device). A device index counts the visible devices (CUDA_ / HIP_VISIBLE_DEVICES).
    """
    driver, _, path = device.partition("://")
    if driver in ("local-task", "local-sync"):
        return _host_available()
    if driver not in ("cuda", "hip") or not (path or "0").isdigit():
        return None
    index = int(path or 0)
    visible = os.environ.get("CUDA_VISIBLE_DEVICES" if driver == "cuda" else "HIP_VISIBLE_DEVICES")
    if visible is not None:  # index counts the visible devices; the tools below count all of them
        ids = [v.strip() for v in visible.split(",")]
        if index >= len(ids):
            return None
        ident = ids[index]
    else:
        ident = str(index)
    return _cuda_free(ident) if driver == "cuda" else _hip_free(ident, sysfs)


def _cuda_free(ident: str) -> int | None:
    """nvidia-smi's free memory of GPU `ident` (an index or a UUID), or None without a working nvidia-smi."""
    try:
        r = subprocess.run(["nvidia-smi", f"--id={ident}", "--query-gpu=memory.free", "--format=csv,noheader,nounits"],
                           capture_output=True, text=True, timeout=20)
        return int(r.stdout.split()[0]) * 2**20 if r.returncode == 0 else None  # MiB
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return None


def _hip_free(ident: str, sysfs: Path) -> int | None:
    """VRAM total - used of the `ident`-th amdgpu card (cards with VRAM counters, by number), or None."""
    if not ident.isdigit():
        return None  # a UUID: no sysfs file names it
    cards = sorted((c for c in (sysfs / "class" / "drm").glob("card*")
                    if c.name[4:].isdigit() and (c / "device" / "mem_info_vram_total").is_file()),
                   key=lambda c: int(c.name[4:]))
    if int(ident) >= len(cards):
        return None
    dev = cards[int(ident)] / "device"
    try:
        return max(0, int((dev / "mem_info_vram_total").read_text()) - int((dev / "mem_info_vram_used").read_text()))
    except (OSError, ValueError):
        return None


def _host_available() -> int | None:
    found = []
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                found.append(int(line.split()[1]) * 1024)
        cgroup = Path("/sys/fs/cgroup")
        limit = (cgroup / "memory.max").read_text().strip() if (cgroup / "memory.max").is_file() else "max"
        if limit != "max":
            found.append(int(limit) - int((cgroup / "memory.current").read_text()))
        import resource

        soft, _ = resource.getrlimit(resource.RLIMIT_AS)
        if soft != resource.RLIM_INFINITY:
            size = next(int(line.split()[1]) * 1024 for line in Path("/proc/self/status").read_text().splitlines()
                        if line.startswith("VmSize:"))
            found.append(soft - size)
    except (OSError, ValueError, IndexError, StopIteration):
        pass
    return max(0, min(found)) if found else None


def _nbytes(entries) -> int:
    total = 0
    for e in entries:
        n = 1
        for d in e["shape"]:
            n *= int(d)
        total += n * DTYPES[e["dtype"]].bytes
    return total


def memory_needed(manifest: Manifest) -> tuple[int, int]:
    """(bytes of the module's state, the KV caches; bytes of its parameters), from the manifest's
    `state.globals` and `parameters` ({shape, dtype} entries, dtype a DTYPES name).

    Raises:
        KeyError: a dtype that is not in DTYPES (Manifest.from_json does not check entries).
    """
    state = _nbytes(manifest.state["globals"].values())
    params = sum(_nbytes(scope.values()) for scope in manifest.parameters.values())
    return state, params


def out_of_memory(manifest: Manifest, folder: Path, device: str, detail: str) -> DFlashError:
    """The error for an IREE RESOURCE_EXHAUSTED while loading or running: bytes needed against free,
    and the largest `--max-context` (a multiple of kv_page) whose KV caches would fit.

    Args:
        device: the IREE device name it ran on ("cuda://1"), or the manifest's driver.
        detail: IREE's message (its first line is quoted).
    """
    state, params = memory_needed(manifest)
    free = _available_bytes(device)
    C, page = manifest.max_context, manifest.kv_page
    # only caches of max_context rows grow with it: a sliding drafter's ring does not
    entries = manifest.state["globals"].values()
    growing = _nbytes([e for e in entries if len(e["shape"]) > 3 and int(e["shape"][3]) == C])
    fixed = state - growing
    line = (f"out of device memory with {folder}: the KV caches need {state / 2**20:.1f} MiB at max_context {C} and "
            f"the weights {params / 2**20:.1f} MiB")
    if free is not None:
        # a fifth kept back for the working buffers a call allocates beside the caches
        room = 0.8 * free - params - fixed
        fit = int(room / (growing / C)) // page * page if room > 0 and growing else 0
        line += f", {free / 2**20:.1f} MiB are free"
        if fit >= C:
            line += "; that is enough, so something else took the memory meanwhile: free the device and retry"
        elif fit >= 64:
            line += f"; recompile with --max-context {fit} or less"
        else:
            line += "; the weights alone (almost) fill it: use a device with more memory, or a smaller --dtype"
    else:
        line += "; recompile with a smaller --max-context (the caches scale with it), or free the device"
    first = detail.splitlines()[0].split("; while ")[0][:240] if detail else "RESOURCE_EXHAUSTED"
    return DFlashError(f"{line} (IREE: {first})")


def check_writable(path: str | Path, option: str) -> None:
    """Refuse an output file that cannot be written, before the work that fills it.

    Raises:
        DFlashError: the path is a folder, its folder does not exist, or is not writable.
    """
    path = Path(path)
    if path.is_dir():
        raise DFlashError(f"{option} {path} is a folder; give a file name")
    parent = path.parent
    if not parent.is_dir():
        raise DFlashError(f"{option} {path}: the folder {parent} does not exist; create it or choose another path")
    if not os.access(parent, os.W_OK) or (path.exists() and not os.access(path, os.W_OK)):
        raise DFlashError(f"{option} {path} is not writable; choose another path")


def write_atomic(path: str | Path, text: str) -> None:
    """Write `text` to `path` whole or not at all: a temporary file beside it, renamed into place."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.partial")
    try:
        tmp.write_text(text)
        tmp.replace(path)
    finally:
        tmp.unlink(missing_ok=True)


def run_tool(cmd: list[str]) -> subprocess.CompletedProcess:
    """Run a tool (iree-compile) to the end, capturing its text output, and kill it with every
    process it started when this process is interrupted or fails meanwhile.

    The tool runs in a session of its own, so the whole group can be killed: the pinned
    `iree-compile` is a Python launcher that starts the compiler binary as its child, which
    killing the launcher alone would leave running.
    """
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate()
    except BaseException:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()
        raise
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)
