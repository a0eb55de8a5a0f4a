"""`dflash-iree compile`'s refusals: bad configs, archs and options, and an `--out` that is not ours to
replace (the user's files, a symbolic link, a manifest that cannot list its files). Each is refused
with one line and exit status 2 before anything is written; none compiles anything.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from dflash_iree.cli import main
from dflash_iree.errors import DFlashError
from dflash_iree.export import compile as cc
from dflash_iree.export import out_folder

CONTEXT = 256  # tiny max_context


def _refused(capsys, argv, out: Path, match: str):
    rc = main(["compile", *argv, "--out", str(out)])
    err = capsys.readouterr().err
    assert rc == 2, err
    assert "Traceback" not in err
    assert re.search(match, err), err
    assert not out.exists() and not any(p.name.startswith(f".{out.name}.") for p in out.parent.iterdir())


def test_refuses_unknown_arch(capsys, tmp_path, target_dir, drafter_dir):
    _refused(capsys, ["--arch", "gfx9999", "--target", str(target_dir), "--drafter", str(drafter_dir)],
             tmp_path / "o", r"unknown ARCH 'gfx9999'.*host, gfx1030, gfx1100, gfx1151, gfx1201, sm_80, sm_86, sm_89.*strix-halo")


def test_refuses_missing_config(capsys, tmp_path, drafter_dir):
    _refused(capsys, ["--target", str(tmp_path / "nowhere"), "--drafter", str(drafter_dir)], tmp_path / "o",
             r"config\.json does not exist")


def test_refuses_unsupported_family(capsys, tmp_path, target_dir, drafter_dir):
    folder = tmp_path / "llama"
    folder.mkdir()
    raw = json.loads((target_dir / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**raw, "model_type": "llama"}))
    _refused(capsys, ["--target", str(folder), "--drafter", str(drafter_dir)], tmp_path / "o",
             r"model_type 'llama' is not supported")


def test_refuses_mismatched_drafter(capsys, tmp_path, target_dir, drafter_dir):
    folder = tmp_path / "wide"
    folder.mkdir()
    raw = json.loads((drafter_dir / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**raw, "hidden_size": 96}))
    _refused(capsys, ["--target", str(target_dir), "--drafter", str(folder)], tmp_path / "o",
             r"does not fit target.*hidden_size is 96 in the drafter but 64")


@pytest.mark.parametrize("argv, match", [
    (["--block-size", "1"], r"--block-size 1 is out of range: use 2\.\.8"),
    (["--block-size", "9"], r"--block-size 9 is out of range: use 2\.\.8"),
    (["--max-context", "32"], r"--max-context 32 is out of range"),
    (["--max-context", "100"], r"--max-context 100 is out of range: use a multiple of 32"),
    (["--max-context", "4096"], r"--max-context 4096 is out of range.*1024 \(the target's max_position_embeddings\)"),
    (["--streams", "0", "--max-context", "256"], r"--streams 0 is out of range: use 1\.\.64"),
    (["--streams", "65", "--max-context", "256"], r"--streams 65 is out of range: use 1\.\.64"),
    (["--draft-top-k", "65", "--max-context", "256"], r"--draft-top-k 65 is out of range: use 1\.\.64 .*or 0 for no draft_topk"),
    (["--draft-top-k", "-1", "--max-context", "256"], r"--draft-top-k -1 is out of range"),
    (["--decode-steps", "17", "--max-context", "256"], r"--decode-steps 17 is out of range: use 2\.\.16"),
    (["--decode-steps", "4", "--streams", "2", "--max-context", "256"], r"--decode-steps 4: .* one stream"),
])
def test_refuses_out_of_range(capsys, tmp_path, target_dir, drafter_dir, argv, match):
    _refused(capsys, ["--target", str(target_dir), "--drafter", str(drafter_dir), *argv], tmp_path / "o", match)


def test_refuses_to_replace_a_folder_that_is_not_an_artifact(capsys, tmp_path, target_dir, drafter_dir):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "keep.txt").write_text("x")
    rc = main(["compile", "--target", str(target_dir), "--drafter", str(drafter_dir), "--out", str(out),
               "--max-context", str(CONTEXT)])
    err = capsys.readouterr().err
    assert rc == 2 and "is not an artifact folder" in err and "Traceback" not in err
    assert sorted(p.name for p in out.iterdir()) == ["keep.txt"]


def _artifact_folder(out: Path, files: dict, extra: dict[str, str]) -> Path:
    """An artifact folder as a compile leaves it (a manifest listing `files`), plus the user's `extra`."""
    out.mkdir()
    (out / "manifest.json").write_text(json.dumps({"files": files}))
    for name, text in {**{n: "module" for n in files}, **extra}.items():
        (out / name).write_text(text)
    return out


def test_refuses_to_replace_an_artifact_folder_holding_the_users_files(capsys, tmp_path, target_dir, drafter_dir):
    out = _artifact_folder(tmp_path / "art", {"dflash.vmfb": "0" * 64}, {"notes.md": "mine", "results.json": "{}"})
    before = {p.name: p.read_text() for p in out.iterdir()}
    rc = main(["compile", "--target", str(target_dir), "--drafter", str(drafter_dir), "--out", str(out),
               "--max-context", str(CONTEXT)])
    err = capsys.readouterr().err
    assert rc == 2 and "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert "does not list (notes.md, results.json)" in err and "--out" in err
    assert {p.name: p.read_text() for p in out.iterdir()} == before


def test_refuses_a_symlinked_or_empty_out(capsys, tmp_path, target_dir, drafter_dir):
    real = _artifact_folder(tmp_path / "real", {"dflash.vmfb": "0" * 64}, {})
    link = tmp_path / "link"
    link.symlink_to(real)
    before = sorted(p.name for p in tmp_path.iterdir())
    for out, needle in ((link, f"--out {link} is a symbolic link"), ("", "--out is empty")):
        rc = main(["compile", "--target", str(target_dir), "--drafter", str(drafter_dir), "--out", str(out),
                   "--max-context", str(CONTEXT)])
        err = capsys.readouterr().err
        assert rc == 2 and needle in err and "Traceback" not in err
    assert sorted(p.name for p in tmp_path.iterdir()) == before and link.is_symlink()


@pytest.mark.parametrize("manifest_text", ["{not json", "{}", '{"files": 3}'])
def test_refuses_an_artifact_folder_whose_manifest_cannot_list_its_files(tmp_path, manifest_text):
    out = tmp_path / "art"
    out.mkdir()
    (out / "manifest.json").write_text(manifest_text)
    (out / "dflash.vmfb").write_text("module")
    with pytest.raises(DFlashError, match=r"manifest.json is unreadable or has no 'files' list"):
        out_folder.check_destination(out)


def test_a_file_put_into_the_folder_during_the_compile_is_not_lost(tmp_path):
    out = _artifact_folder(tmp_path / "art", {"dflash.vmfb": "0" * 64}, {})
    stage = tmp_path / "stage"
    stage.mkdir()
    (stage / "manifest.json").write_text(json.dumps({"files": {}}))
    (out / "late.txt").write_text("mine")  # after the check at the start of the compile
    with pytest.raises(DFlashError, match="late.txt"):
        out_folder.replace(stage, out)
    assert (out / "late.txt").read_text() == "mine" and (out / "dflash.vmfb").exists()
    (out / "late.txt").unlink()
    out_folder.replace(stage, out)  # only ours: replaced
    assert sorted(p.name for p in out.iterdir()) == ["manifest.json"]


def test_aliases():
    assert cc.resolve_arch("strix-halo")[0].name == "gfx1151"
    assert cc.resolve_arch("rx7900xtx")[0].name == "gfx1100"
    for hopper in ("h100", "h200"):
        arch, note = cc.resolve_arch(hopper)
        assert arch.name == "sm_80" and "sm_90" in note
    for hopper in ("sm_90", "sm_90a"):  # no such target in the pinned compiler: the message gives the way
        with pytest.raises(DFlashError, match=rf"--arch {hopper}: .*no sm_90 target.*use --arch h200 or h100 \(sm_80\)"):
            cc.resolve_arch(hopper)


def test_refuses_sm_90_with_the_way_that_works(capsys, tmp_path, target_dir, drafter_dir):
    _refused(capsys, ["--arch", "sm_90", "--target", str(target_dir), "--drafter", str(drafter_dir)],
             tmp_path / "o", r"no sm_90 target .*JIT-compiled for Hopper.*use --arch h200 or h100 \(sm_80\)")


def test_a_dtype_other_than_the_checkpoints_warns(target_dir, drafter_dir):
    """The runtime binds tensors as stored: f16 artifacts of an f32 checkpoint need an f16 copy."""
    from dflash_iree.guard import DFlashWarning

    with pytest.warns(DFlashWarning, match="--dtype f16: the target's config.json says f32.*convert them"):
        cc.plan(target_dir, drafter_dir, dtype="f16")


@pytest.mark.parametrize("argv, match", [
    (["--draft-top-k", "999"], r"--draft-top-k 999 is out of range"),  # plan's own check, after the dtype's
    (["--out", "FILE"], r"--out .*FILE is a file, not an artifact folder")])
def test_a_refused_compile_prints_no_dtype_warning(capsys, tmp_path, target_dir, drafter_dir, argv, match):
    """The --dtype warning comes only once every check has passed: a refusal is the one line."""
    (tmp_path / "FILE").write_text("mine")
    argv = [str(tmp_path / a) if a == "FILE" else a for a in argv]
    rc = main(["compile", "--target", str(target_dir), "--drafter", str(drafter_dir), "--dtype", "f16",
               "--max-context", str(CONTEXT), *(argv if "--out" in argv else [*argv, "--out", str(tmp_path / "o")])])
    err = capsys.readouterr().err
    assert rc == 2 and re.search(match, err) and len(err.strip().splitlines()) == 1 and "warning" not in err, err
