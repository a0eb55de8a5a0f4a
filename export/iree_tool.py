"""Running the pinned iree-compile: where it is, the command with its scheduling statistics, and
what those statistics say (executables, dispatches in all and per call of each function).

export/compile.py `lower()` runs it once per arch; the benchmarks call it for their own modules.
"""

from __future__ import annotations

import json
import re
import shutil
import sys
from pathlib import Path

from dflash_iree import guard
from dflash_iree.errors import DFlashError


def iree_compile_tool() -> str:
    """Path of the pinned iree-compile (beside this Python, else on PATH)."""
    here = Path(sys.executable).parent / "iree-compile"
    found = str(here) if here.is_file() else shutil.which("iree-compile")
    if not found:
        raise DFlashError("iree-compile was not found; install the compile extra: pip install 'dflash-iree[compile]'")
    return found


def run_iree_compile(mlir: Path, vmfb: Path, flags: list[str], stats: Path, extra: list[str] = ()) -> None:
    """iree-compile MLIR -> vmfb with scheduling statistics (csv) written to `stats`."""
    cmd = [iree_compile_tool(), str(mlir), *flags, *extra, "--iree-scheduling-dump-statistics-format=csv",
           f"--iree-scheduling-dump-statistics-file={stats}", "-o", str(vmfb)]
    proc = guard.run_tool(cmd)  # killed with its children on Ctrl-C
    if proc.returncode != 0:
        # The errors, shortened (their target attributes run to kilobytes), and the dispatches named.
        lines = proc.stderr.splitlines()
        errors = [line[:240] for line in lines if "error:" in line][:6]
        dispatches = sorted(set(re.findall(r'sym_name = "([^"]*dispatch[^"]*)"', proc.stderr)))[:6]
        detail = "\n".join(errors + [f"  in {d}" for d in dispatches]) or "\n".join(lines[-10:])
        raise DFlashError(f"iree-compile failed (exit {proc.returncode}):\n{detail}")


def scheduling_stats(path: Path) -> dict:
    """From iree-compile's scheduling statistics (csv): executable, dispatch, copy and fill counts of
    the whole module, and the dispatches one call of each function runs (static count)."""
    lines = path.read_text().splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith('"Constants"'))
    agg = dict(zip(json.loads(f"[{lines[header]}]"), json.loads(f"[{lines[header + 1]}]")))
    per_call: dict[str, int] = {}
    function = None
    for line in lines[header + 2:]:
        if line.startswith("; "):
            m = re.search(r"util\.func @([\w$]+)", line)
            function = m[1].removesuffix("$async") if m else None
        elif function and ',"dispatch",' in line:
            per_call[function] = per_call.get(function, 0) + 1
    return {"executables": agg["Executables"], "dispatches": agg["Dispatches"], "copies": agg["Copies"],
            "fills": agg["Fills"], "dispatches_per_call": per_call}
