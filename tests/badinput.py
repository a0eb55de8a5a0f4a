"""Helpers of the bad-input tests: run the CLI, assert a clean refusal, snapshot folders."""

from __future__ import annotations

import hashlib
import subprocess
import sys
from pathlib import Path

from dflash_iree.cli import main


def cli(capsys, *args) -> tuple[int, str, str]:
    """`dflash-iree ARGS` in this process: (exit status, stdout, stderr). An exception other than
    the CLI's own handling (a traceback, for a user) fails the test where it is raised."""
    try:
        rc = main([str(a) for a in args])
    except SystemExit as e:  # argparse's own refusals
        rc = e.code
    out, err = capsys.readouterr()
    return rc, out, err


def dflash(*args, timeout: float = 300, **kw) -> subprocess.CompletedProcess:
    """`python -m dflash_iree ARGS` in a subprocess (a crash shows as a negative status)."""
    return subprocess.run([sys.executable, "-m", "dflash_iree", *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, **kw)


def assert_refused(rc: int, err: str, *needles: str) -> None:
    """Exit status 2, one `dflash-iree: error:` message holding every needle, no traceback."""
    assert rc == 2, f"exit status {rc}, stderr:\n{err}"
    assert "Traceback" not in err, err
    assert err.count("dflash-iree: error:") == 1 or "error: argument" in err, err
    for n in needles:
        assert n in err, f"{n!r} not in:\n{err}"


def snapshot(folder: Path) -> dict | None:
    """{relative path: (size, sha256)} of every file under `folder`, or None when it is absent."""
    folder = Path(folder)
    if not folder.exists():
        return None
    return {str(p.relative_to(folder)): (p.stat().st_size, hashlib.sha256(p.read_bytes()).hexdigest())
            for p in sorted(folder.rglob("*")) if p.is_file()}
