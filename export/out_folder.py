"""The `--out` folder of a compile: whether it is ours to replace, and replacing it whole.

A compile writes into a stage folder beside `--out` (`stage_beside`) and renames it into place
(`replace`), so an interrupted compile leaves no half artifact. It replaces only what an earlier
compile wrote: a folder holding nothing but a manifest.json and the files that manifest lists
(`check_destination`), never the user's notes, results or a second model. The lock that keeps two
compiles out of one `--out` at once is dflash_iree/guard.py `out_lock`.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

from dflash_iree.errors import DFlashError
from dflash_iree.manifest import MANIFEST_FILE


def stage_beside(out: Path) -> Path:
    """A new, empty stage folder in `out`'s parent (made if missing), with the permissions of an
    ordinary folder."""
    out.parent.mkdir(parents=True, exist_ok=True)
    stage = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".partial", dir=out.parent))
    umask = os.umask(0)
    os.umask(umask)
    stage.chmod(0o777 & ~umask)  # mkdtemp makes it private; the artifact folder is an ordinary one
    return stage


def check_destination(out: Path) -> None:
    """Refuse an `--out` that is not ours to replace: a file, or a folder holding anything but a
    manifest and the files that manifest lists (the user's notes, results or a second model)."""
    if out.is_symlink():
        raise DFlashError(f"--out {out} is a symbolic link (to {os.readlink(out)}); a compile replaces the folder "
                          f"whole, so give the folder itself: --out {out.resolve()}")
    if not out.exists():
        return
    if not out.is_dir():
        raise DFlashError(f"--out {out} is a file, not an artifact folder; choose another --out")
    entries = sorted(p.name for p in out.iterdir())
    if not entries:
        return
    if MANIFEST_FILE not in entries:
        raise DFlashError(f"{out} exists and is not an artifact folder (no {MANIFEST_FILE}); choose another --out")
    try:
        listed = json.loads((out / MANIFEST_FILE).read_text())["files"]
        ours = {MANIFEST_FILE, *listed}
    except (OSError, ValueError, KeyError, TypeError):
        raise DFlashError(f"{out / MANIFEST_FILE} is unreadable or has no 'files' list, so the folder's files cannot "
                          f"be told from yours; choose another --out, or empty {out}") from None
    foreign = [name for name in entries if name not in ours]
    if foreign:
        shown = ", ".join(foreign[:8]) + (f" and {len(foreign) - 8} more" if len(foreign) > 8 else "")
        raise DFlashError(f"{out} holds files that its {MANIFEST_FILE} does not list ({shown}); a compile replaces "
                          f"the whole folder, so move them out or choose another --out")


def replace(stage: Path, out: Path) -> None:
    """Move the finished stage folder to `out`, replacing an earlier artifact folder (checked again
    here, just before, so that a file put there during the compile is not lost)."""
    check_destination(out)
    if out.exists():
        old = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".old", dir=out.parent))
        old.rmdir()
        out.rename(old)
        stage.rename(out)
        shutil.rmtree(old, ignore_errors=True)
    else:
        stage.rename(out)
