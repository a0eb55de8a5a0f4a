"""Compiles that meet a fault (issue #22): a full disk, a second compile into the same `--out`, a
folder that cannot be written, `--max-context` below the minimum, and Ctrl-C during the export,
during iree-compile and during a generation. Each ends in one line and exit status 2 (130 for
Ctrl-C), without a traceback, and leaves `--out` as it was with no stage folder, no partial export
cache entry and no lock behind.

The fault tests in this process replace the export and iree-compile with stand-ins (the module
file of the session's host artifacts), so that they exercise the compile's own file handling in
seconds; the Ctrl-C tests interrupt real compiles and a real generation in subprocesses.
"""

from __future__ import annotations

import errno
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from badinput import assert_refused, cli, snapshot

from dflash_iree import guard
from dflash_iree.export import compile as cc

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def fake_lowering(monkeypatch, host_artifacts, tmp_path):
    """Export and iree-compile replaced by stand-ins: the 'export' is a file, the 'module' is the
    session's dflash.vmfb, the statistics are fixed."""
    mlir = tmp_path / "export.mlirbc"
    mlir.write_bytes(b"stand-in export")
    monkeypatch.setattr(cc, "export_cached", lambda p, work, log=None, use_cache=True: mlir)
    monkeypatch.setattr(cc, "splice_file", lambda src, dst, arch, splices=None: (Path(src), [], {}))

    def iree_compile(src, vmfb, flags, stats, extra=()):
        shutil.copy(host_artifacts / "dflash.vmfb", vmfb)
        Path(stats).write_text("stand-in statistics\n")

    monkeypatch.setattr(cc, "run_iree_compile", iree_compile)
    monkeypatch.setattr(cc, "scheduling_stats", lambda path: {"executables": 1, "dispatches": 1, "copies": 0, "fills": 0,
                                                    "dispatches_per_call": {}})
    return iree_compile


def _compile(capsys, target_dir, drafter_dir, out, *extra):
    return cli(capsys, "compile", "--arch", "host", "--target", target_dir, "--drafter", drafter_dir, "--out", out,
               "--max-context", "256", *extra)


def _left_behind(out: Path) -> list[str]:
    """Stage folders, old folders and the lock that a compile into `out` may create beside it."""
    return sorted(p.name for p in out.parent.iterdir() if p.name.startswith(f".{out.name}."))


def test_the_stand_ins_compile(capsys, fake_lowering, target_dir, drafter_dir, tmp_path):
    out = tmp_path / "host"
    rc, _, err = _compile(capsys, target_dir, drafter_dir, out)
    assert rc == 0, err
    assert sorted(p.name for p in out.iterdir()) == ["dflash.vmfb", "manifest.json"] and _left_behind(out) == []


def _no_space(path):
    return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))


@pytest.mark.parametrize("where", ["module", "manifest"])
def test_full_disk_during_compile_leaves_out_as_it_was(capsys, monkeypatch, fake_lowering, host_artifacts, target_dir,
                                                       drafter_dir, tmp_path, where):
    out = Path(shutil.copytree(host_artifacts, tmp_path / "host"))  # an earlier compile's folder: replaceable
    before = snapshot(out)
    if where == "module":
        def full(src, vmfb, *a, **k):
            Path(vmfb).write_bytes(b"half a mod")
            raise _no_space(vmfb)

        monkeypatch.setattr(cc, "run_iree_compile", full)
    else:
        write_text = Path.write_text

        def full(self, *a, **k):
            if self.name == "manifest.json":
                write_text(self, "{\"half")
                raise _no_space(self)
            return write_text(self, *a, **k)

        monkeypatch.setattr(Path, "write_text", full)
    rc, _, err = _compile(capsys, target_dir, drafter_dir, out)
    assert_refused(rc, err, "No space left on device", "free some space", "--out was left as it was")
    assert snapshot(out) == before and _left_behind(out) == []


def test_full_disk_during_export_leaves_no_cache_entry(capsys, monkeypatch, target_dir, drafter_dir, tmp_path):
    cache = tmp_path / "cache"
    monkeypatch.setenv("DFLASH_IREE_CACHE", str(cache))

    def full(p, path, log=None):
        Path(path).write_bytes(b"half an export")
        raise _no_space(path)

    monkeypatch.setattr(cc, "export_mlir", full)
    out = tmp_path / "host"
    rc, _, err = _compile(capsys, target_dir, drafter_dir, out)
    assert_refused(rc, err, str(cache), "No space left on device")
    assert list(cache.iterdir()) == [] and not out.exists() and _left_behind(out) == []


def test_second_compile_into_one_out_refused(capsys, fake_lowering, target_dir, drafter_dir, tmp_path):
    """A compile holding the lock (another process) makes a second one refuse, naming its pid and
    the lock; once the holder is gone (killed: its lock file stays, unheld), a compile proceeds."""
    out = tmp_path / "host"
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time\nfrom dflash_iree.guard import out_lock\n"
                               "with out_lock(sys.argv[1]):\n    print('held', flush=True)\n    time.sleep(120)",
                               str(out)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        rc, _, err = _compile(capsys, target_dir, drafter_dir, out)
        assert_refused(rc, err, f"another dflash-iree compile (pid {holder.pid}) is writing {out}",
                       str(guard.lock_path(out)))
        assert not out.exists()
    finally:
        holder.kill()
        holder.wait()
    assert guard.lock_path(out).exists()  # left by the killed holder, not held
    rc, _, err = _compile(capsys, target_dir, drafter_dir, out)
    assert rc == 0, err
    assert _left_behind(out) == [] and (out / "manifest.json").is_file()


def test_out_that_cannot_be_written(capsys, monkeypatch, fake_lowering, host_artifacts, target_dir, drafter_dir,
                                    tmp_path):
    """A read-only --out is refused before the export (root ignores permissions: os.access stands in)."""
    out = Path(shutil.copytree(host_artifacts, tmp_path / "host"))
    before = snapshot(out)
    monkeypatch.setattr(guard.os, "access", lambda path, mode: Path(path) != out)
    rc, _, err = _compile(capsys, target_dir, drafter_dir, out)
    assert_refused(rc, err, f"--out {out}: {out} is not writable", "choose another --out")
    assert snapshot(out) == before and _left_behind(out) == []


def test_permission_error_while_writing_is_one_line(capsys, monkeypatch, fake_lowering, target_dir, drafter_dir,
                                                    tmp_path):
    def denied(*a, **k):
        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(tmp_path / "x"))

    monkeypatch.setattr(cc.tempfile, "mkdtemp", denied)
    out = tmp_path / "host"
    rc, _, err = _compile(capsys, target_dir, drafter_dir, out)
    assert_refused(rc, err, "Permission denied", "choose another folder", "--out was left as it was")
    assert not out.exists() and _left_behind(out) == []


def test_max_context_minimum_agrees_with_the_readme(capsys, target_dir, drafter_dir, tmp_path):
    rc, _, err = _compile(capsys, target_dir, drafter_dir, tmp_path / "x", "--max-context", "32")
    assert_refused(rc, err, f"--max-context 32 is out of range: use a multiple of 32 from {cc.MIN_CONTEXT} to 1024")
    assert f"a multiple of 32 from {cc.MIN_CONTEXT} up to" in (ROOT / "README.md").read_text()


# -- Ctrl-C ---------------------------------------------------------------------------------

def _wait_for(proc: subprocess.Popen, stream, text: str, timeout: float) -> str:
    """Read `stream` of `proc` until it holds `text` ("": any output); returns what was read."""
    seen, deadline = "", time.monotonic() + timeout
    while text not in seen or not seen:
        left = deadline - time.monotonic()
        assert left > 0 and proc.poll() is None, f"no {text!r} within {timeout}s:\n{seen}"
        ready, _, _ = select.select([stream], [], [], left)
        if ready:
            seen += os.read(stream.fileno(), 65536).decode(errors="replace")
    return seen


def _sigint_default() -> None:
    """In the child before exec: Ctrl-C's default action. A process started in the background of a
    shell without job control inherits SIGINT ignored, and Python then keeps ignoring it, so a
    test run launched that way could not interrupt the CLI at all."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _interrupt(proc: subprocess.Popen) -> tuple[int, str]:
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    return proc.returncode, err.decode(errors="replace")


def _assert_interrupted(rc: int, err: str) -> None:
    assert rc == 130, err
    assert "Traceback" not in err and err.strip().splitlines()[-1].startswith("dflash-iree: interrupted"), err


def _compile_process(target_dir, drafter_dir, out, max_context, env):
    return subprocess.Popen([sys.executable, "-m", "dflash_iree", "compile", "--arch", "host", "--target", str(target_dir),
                             "--drafter", str(drafter_dir), "--out", str(out), "--max-context", str(max_context)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, cwd=str(ROOT),
                            preexec_fn=_sigint_default)


def _iree_compile_running(out: Path) -> bool:
    """Whether an iree-compile writing into a stage folder of `out` is alive (a zombie, killed and
    waiting to be reaped, is not)."""
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if state in ("Z", "X"):
            continue
        if b"iree-compile" in cmd and f".{out.name}.".encode() in cmd and str(out.parent).encode() in cmd:
            return True
    return False


def test_ctrl_c_during_the_export(target_dir, drafter_dir, tmp_path):
    cache, tmp = tmp_path / "cache", tmp_path / "tmp"
    tmp.mkdir()
    env = {**os.environ, "DFLASH_IREE_CACHE": str(cache), "TMPDIR": str(tmp)}
    out = tmp_path / "host"
    proc = _compile_process(target_dir, drafter_dir, out, 128, env)  # 128: an export no other test made
    _wait_for(proc, proc.stdout, "export: traced", 300)
    _assert_interrupted(*_interrupt(proc))
    assert not out.exists() and _left_behind(out) == [] and list(tmp.iterdir()) == []
    assert not cache.exists() or list(cache.iterdir()) == []


def test_ctrl_c_during_iree_compile(host_artifacts, target_dir, drafter_dir, tmp_path):
    if cc.cache_dir() is None:
        pytest.skip("the export cache is off")
    p = cc.plan(target_dir, drafter_dir, max_context=256, attention="matmul")
    cc.export_cached(p, tmp_path, log=lambda m: None)  # so the subprocess goes straight to iree-compile
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    out = tmp_path / "host"
    proc = _compile_process(target_dir, drafter_dir, out, 256, {**os.environ, "TMPDIR": str(tmp)})
    _wait_for(proc, proc.stdout, "compile: iree-compile for host", 300)
    time.sleep(1.0)
    assert _iree_compile_running(out)
    _assert_interrupted(*_interrupt(proc))
    assert not out.exists() and _left_behind(out) == [] and list(tmp.iterdir()) == []
    assert not _iree_compile_running(out)


def test_ctrl_c_during_generate(long_artifacts):
    before = snapshot(long_artifacts)
    proc = subprocess.Popen([sys.executable, "-m", "dflash_iree", "generate", "--artifacts", str(long_artifacts),
                             "--prompt", "def fibonacci(n):", "--max-new-tokens", "10000"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, preexec_fn=_sigint_default)
    _wait_for(proc, proc.stdout, "", 300)  # text is streaming
    _assert_interrupted(*_interrupt(proc))
    assert snapshot(long_artifacts) == before
