"""`dflash-iree calibrate --artifacts DIR`: measure the cost of a shared round per verified rows on
this machine and write it into the artifact folder as depth_cost.json, listed in the manifest's
`files` (the draft depth rule's cost model, runtime/depth.py).

What is timed, each call of all S streams with its outputs read (the host waits for them, as the
batch engine does): every `verify_rows{R}` round (R - 1 drafts a stream), the plain step that keeps
the drafter's context (`prefill` of one row per stream + `absorb`, the rule's fallback), and, for
the record, `decode` and the whole-block `verify_draft`. The calls run at `context` cached rows
(attention reads `context + R`), interleaved call by call so that a busy machine slows all of them
alike, and the median of `repeats` is kept. The cache contents are whatever the fresh module holds:
the time of a call does not depend on them. Greedy calls only: the sampled variants add the same
vocabulary-wide work to every round, small beside a round at these shapes.

The file is written through a temporary file and renamed, then the manifest likewise; a failure
leaves both as they were.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from datetime import datetime, timezone
from pathlib import Path

from dflash_iree import guard, validate
from dflash_iree.checkpoint import sha256_file
from dflash_iree.errors import DFlashError
from dflash_iree.manifest import DEPTH_COST_FILE, MANIFEST_FILE

from .depth import COST_FORMAT, compiled_rows
from .stream_calls import GREEDY, StreamCalls

DEFAULT_REPEATS = 20
DEFAULT_CONTEXT = 128


def measure(folder: str | Path, device: str | None = None, repeats: int = DEFAULT_REPEATS,
            context: int | None = None, log=None) -> dict:
    """Time the rounds of the module in `folder` (see the module docstring); writes nothing.

    Args:
        repeats: timed calls of each kind (after 2 untimed).
        context: cached rows the calls run at; default min(128, the room max_context leaves).

    Returns:
        The cost file's JSON object: format, streams, block_size, context, repeats, device, arch,
        measured_utc, rows_ms {R: ms}, fallback_ms, decode_ms, verify_draft_ms.

    Raises:
        DFlashError: a bad artifact folder (Artifacts.load; the cost file itself is not checked),
            a module of one stream (no `verify_rows`), repeats < 1, a context out of range.
    """
    from .artifacts import Artifacts, open_device

    folder = Path(folder)
    arts = Artifacts.load(folder, unchecked=(DEPTH_COST_FILE,))
    m = arts.manifest
    rows = compiled_rows(m)
    if not rows and int(m.streams) > 1:
        raise DFlashError(f"{folder} has no verify_rows entry points (a hybrid target's module of {m.streams} streams): "
                          "the draft depth rule does not serve hybrid targets yet; serve it without calibrating")
    if not rows:
        raise DFlashError(f"{folder} has no verify_rows entry points (a module of {m.streams} stream): the draft depth "
                          "of shared rounds needs artifacts compiled with --streams 2 or more")
    repeats = validate.count(repeats, "--repeats", "timed calls of each kind")
    S, B = int(m.streams), int(m.block_size)
    room = int(m.max_context) - B - 1
    context = min(DEFAULT_CONTEXT, room) if context is None else context
    if isinstance(context, bool) or not isinstance(context, int) or not 0 <= context <= room:
        raise DFlashError(f"--context {context!r} is out of range: use 0..{room} (max_context {m.max_context} less a block)")
    calls = StreamCalls(arts.bind(open_device(arts, device), device_name=device), S)
    starts, greedy = [context] * S, [GREEDY] * S
    kinds = {f"rows{R}": (lambda R=R: calls.verify_rows(R, [[0] * R] * S, starts, [R - 1] * S, greedy)) for R in rows}
    kinds["fallback"] = lambda: calls.plain_step([0] * S, starts, greedy)
    kinds["decode"] = lambda: calls.decode([0] * S, starts, greedy)
    kinds["verify_draft"] = lambda: calls.verify_draft([[0] * B] * S, starts, [B - 1] * S, greedy)
    times: dict[str, list[float]] = {k: [] for k in kinds}
    for i in range(repeats + 2):
        for name, call in kinds.items():
            t0 = time.perf_counter()
            call()
            if i >= 2:
                times[name].append((time.perf_counter() - t0) * 1e3)
    ms = {k: round(statistics.median(v), 4) for k, v in times.items()}
    if log:
        log("  ".join(f"{k} {v:.3f} ms" for k, v in ms.items()))
    return {"format": COST_FORMAT,
            "doc": "median ms of one call of all streams per verified rows (verify_rows{R}); fallback: prefill of one "
                   "row per stream + absorb; written by dflash-iree calibrate (runtime/calibrate.py)",
            "streams": S, "block_size": B, "context": context, "repeats": repeats,
            "device": device or m.driver, "arch": m.arch,
            "measured_utc": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
            "rows_ms": {str(R): ms[f"rows{R}"] for R in rows}, "fallback_ms": ms["fallback"],
            "decode_ms": ms["decode"], "verify_draft_ms": ms["verify_draft"]}


def write(folder: str | Path, costs: dict) -> Path:
    """Write `costs` as folder/depth_cost.json and list it in folder/manifest.json's files, each
    through a temporary file renamed into place. Returns the cost file's path.

    Raises:
        DFlashError: the folder cannot be written (nothing changed).
    """
    folder = Path(folder)
    data = guard.read_manifest(folder)
    path, manifest_path = folder / DEPTH_COST_FILE, folder / MANIFEST_FILE
    tmp_cost, tmp_manifest = folder / f".{DEPTH_COST_FILE}.{os.getpid()}.tmp", folder / f".{MANIFEST_FILE}.{os.getpid()}.tmp"
    try:
        tmp_cost.write_text(json.dumps(costs, indent=1) + "\n")
        data["files"] = {**data["files"], DEPTH_COST_FILE: sha256_file(tmp_cost)}
        tmp_manifest.write_text(json.dumps(data, indent=1) + "\n")
        os.replace(tmp_cost, path)
        os.replace(tmp_manifest, manifest_path)
    except OSError as e:
        raise DFlashError(f"{folder}: cannot write {DEPTH_COST_FILE} ({e.strerror}); calibrate writes into the "
                          "artifact folder: make it writable, or copy the artifacts somewhere writable") from None
    finally:
        for t in (tmp_cost, tmp_manifest):
            t.unlink(missing_ok=True)
    return path


def calibrate(folder: str | Path, device: str | None = None, repeats: int = DEFAULT_REPEATS,
              context: int | None = None, log=print) -> dict:
    """`measure` then `write`: the whole `dflash-iree calibrate`. Returns the cost file's object."""
    costs = measure(folder, device, repeats, context, log)
    path = write(folder, costs)
    if log:
        log(f"wrote {path} (listed in {Path(folder) / MANIFEST_FILE})")
    return costs
