"""Bad files and faults (issue #22): artifact folders, checkpoints, compiles that meet a full disk,
a held lock or a read-only folder, device memory, and Ctrl-C. Each ends in exit status 2 with one
message naming the file or field and the fix (130 and one line for Ctrl-C), no traceback, and the
output folder unchanged or absent; a read-only artifact folder and a drafter trained for another
block size end in a correct result.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from badinput import assert_refused, cli, dflash, snapshot

from dflash_iree import guard
from dflash_iree.errors import DFlashError
from dflash_iree.export import compile as cc
from dflash_iree.manifest import Manifest
from dflash_iree.runtime.engine import Engine

ROOT = Path(__file__).resolve().parents[1]


def _copy(src: Path, dst: Path) -> Path:
    return Path(shutil.copytree(src, dst))


def _generate(capsys, artifacts, *extra):
    return cli(capsys, "generate", "--artifacts", artifacts, "--prompt-ids", "7 300 12", "--max-new-tokens", "6", *extra)


# -- artifact folders ------------------------------------------------------------------------

def _cut(path: Path, keep: float = 0.5) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep)])


def _flip_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def _drop_field(path: Path) -> None:
    m = json.loads(path.read_text())
    del m["entry_points"]
    path.write_text(json.dumps(m))


def _set_field(name: str, value):
    def damage(path: Path) -> None:
        m = json.loads(path.read_text())
        m[name] = value
        path.write_text(json.dumps(m))
    return damage


ARTIFACT_FAULTS = [
    ("manifest-cut-off", "manifest.json", _cut, ["manifest.json is cut off after", "recompile"]),
    ("manifest-not-an-object", "manifest.json", lambda p: p.write_text("[1, 2]\n"), ["manifest.json is not a JSON object"]),
    ("manifest-field-missing", "manifest.json", _drop_field, ["lacks the field(s) entry_points"]),
    ("manifest-block-size-text", "manifest.json", _set_field("block_size", "eight"),
     ["field block_size is 'eight', not an integer", "recompile"]),
    ("manifest-block-size-null", "manifest.json", _set_field("block_size", None), ["field block_size is None"]),
    ("manifest-block-size-bool", "manifest.json", _set_field("block_size", True), ["field block_size is True"]),
    ("manifest-no-entry-points", "manifest.json", _set_field("entry_points", []), ["entry_points has no prefill"]),
    ("manifest-dtype-unknown", "manifest.json", _set_field("dtype", "q4"), ["dtype 'q4' is not one of"]),
    ("manifest-parameters-null", "manifest.json", _set_field("parameters", None), ["field parameters is None, not an object"]),
    ("manifest-files-empty", "manifest.json", _set_field("files", {}), ["files does not list the module dflash.vmfb"]),
    ("manifest-kv-page-zero", "manifest.json", _set_field("kv_page", 0), ["kv_page 0 is out of range"]),
    ("manifest-dtype-not-computed", "manifest.json", _set_field("dtype", "i64"), ["dtype 'i64' is not one of bf16, f16, f32"]),
    ("manifest-state-empty", "manifest.json", _set_field("state", {}), ["state has no globals"]),
    ("vmfb-cut-off", "dflash.vmfb", _cut, ["dflash.vmfb is", "bytes", "cut off or changed"]),
    ("vmfb-changed", "dflash.vmfb", _flip_byte, ["dflash.vmfb: sha256 differs"]),
    ("vmfb-missing", "dflash.vmfb", lambda p: p.unlink(), ["dflash.vmfb is missing (listed in"]),
]


@pytest.mark.parametrize("name,damage,needles", [c[1:] for c in ARTIFACT_FAULTS], ids=[c[0] for c in ARTIFACT_FAULTS])
def test_damaged_artifacts_refused(capsys, host_artifacts, tmp_path, name, damage, needles):
    arts = _copy(host_artifacts, tmp_path / "host")
    damage(arts / name)
    before = snapshot(arts)
    rc, _, err = _generate(capsys, arts)
    assert_refused(rc, err, *needles)
    assert snapshot(arts) == before


def test_manifest_cut_anywhere_is_named_cut_off(host_artifacts, tmp_path):
    """Wherever a manifest is cut (inside a string, a number, between fields), it is named cut off: the
    fault test above cuts at one point, which fell inside a string on one machine and not on another."""
    data = (host_artifacts / "manifest.json").read_bytes()
    for keep in range(1, len(data) - 2, max(1, len(data) // 97)):
        folder = tmp_path / str(keep)
        folder.mkdir()
        (folder / "manifest.json").write_bytes(data[:keep])
        with pytest.raises(DFlashError, match="is cut off after"):
            guard.read_manifest(folder)


def test_artifacts_option_pointing_at_the_vmfb(capsys, host_artifacts):
    rc, _, err = _generate(capsys, host_artifacts / "dflash.vmfb")
    assert_refused(rc, err, "is a file; pass the artifact folder", f"--artifacts {host_artifacts}")
    assert "--out" not in err


def test_artifacts_option_pointing_at_a_checkpoint(capsys, target_dir):
    rc, _, err = _generate(capsys, target_dir)
    assert_refused(rc, err, f"--artifacts {target_dir} is a checkpoint folder", "compile it first")
    assert "--out" not in err


def _world_readable_copy(folders: list[Path]) -> tuple[Path, list[Path]]:
    import tempfile

    top = Path(tempfile.mkdtemp(prefix="dflash-ro-"))
    top.chmod(0o755)
    copies = [Path(shutil.copytree(f, top / f.name)) for f in folders]
    for dirpath, dirnames, filenames in os.walk(top):
        for d in dirnames:
            os.chmod(os.path.join(dirpath, d), 0o555)
        for f in filenames:
            os.chmod(os.path.join(dirpath, f), 0o444)
    return top, copies


def test_read_only_artifact_folder_generates(host_artifacts, target_dir, drafter_dir):
    """A read-only artifact folder (and checkpoints), read as an unprivileged user: the module is
    mapped read-only (IREE's VmModule.mmap opens it for writing, and failed here). Root reads past
    file modes, so as root the run drops to nobody with setpriv; any other user runs it as itself."""
    as_nobody = []
    if os.geteuid() == 0:
        if not shutil.which("setpriv"):
            pytest.skip("as root the modes are not enforced, and there is no setpriv to run as another user")
        as_nobody = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]
        probe = subprocess.run([*as_nobody, sys.executable, "-c", "import dflash_iree"], capture_output=True)
        if probe.returncode != 0:
            # a checkout under a private folder (mktemp -d is mode 0700): nobody cannot reach the venv
            pytest.skip("another user cannot import dflash_iree from this checkout (a parent folder lacks o+x)")
    want = json.loads(dflash("generate", "--artifacts", host_artifacts, "--prompt-ids", "7 300 12",
                             "--max-new-tokens", "6", "--json").stdout)["tokens"]
    top, (arts, target, drafter) = _world_readable_copy([host_artifacts, target_dir, drafter_dir])
    before = snapshot(top)
    try:
        r = subprocess.run([*as_nobody, sys.executable, "-m", "dflash_iree", "generate", "--artifacts", str(arts),
                            "--target", str(target), "--drafter", str(drafter), "--prompt-ids", "7 300 12",
                            "--max-new-tokens", "6", "--json"],
                           capture_output=True, text=True, timeout=300, cwd=str(top))
        assert r.returncode == 0, r.stderr
        assert json.loads(r.stdout)["tokens"] == want
        assert snapshot(top) == before
    finally:
        for dirpath, dirnames, _ in os.walk(top):
            os.chmod(dirpath, 0o755)
        shutil.rmtree(top)


def test_missing_tokenizer_names_the_target_given(capsys, long_artifacts, long_pair, tmp_path):
    target = _copy(long_pair[0], tmp_path / "my-target")
    (target / "tokenizer.json").unlink()
    before = snapshot(target), snapshot(long_artifacts)
    rc, _, err = cli(capsys, "generate", "--artifacts", long_artifacts, "--target", target, "--prompt", "hello")
    assert_refused(rc, err, f"{target}/tokenizer.json does not exist", "--prompt-ids")
    assert str(long_pair[0]) not in err
    assert (snapshot(target), snapshot(long_artifacts)) == before


def _word_tokenizer(folder: Path, vocab_size: int, added: tuple[str, ...] = ()) -> None:
    """A word-level tokenizer.json of ids 0..vocab_size-1 ("w7" is 7), with `added` tokens after them."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({"[UNK]": 0, **{f"w{i}": i for i in range(1, vocab_size)}}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_tokens(list(added))
    tok.save(str(folder / "tokenizer.json"))


def test_tokenizer_with_ids_past_the_vocabulary(capsys, host_artifacts, target_dir, tmp_path):
    """An added token at id vocab_size: refused when the tokenizer loads, naming its tokenizer.json,
    not encoded into an id the embedding gather reads out of bounds (exit 0 with wrong text, before)."""
    target = _copy(target_dir, tmp_path / "target")
    _word_tokenizer(target, 512, ("<zzz>",))
    before, arts = snapshot(target), snapshot(host_artifacts)
    rc, out, err = cli(capsys, "generate", "--artifacts", host_artifacts, "--target", target, "--prompt", "w7 <zzz>",
                       "--max-new-tokens", "4")
    assert_refused(rc, err, f"{target}/tokenizer.json has token ids up to 512 (<zzz>)", "vocab_size is 512",
                   "--prompt-ids")
    assert out == "" and snapshot(target) == before and snapshot(host_artifacts) == arts
    # token ids still work with it; a tokenizer that fits encodes text
    assert _generate(capsys, host_artifacts, "--target", target)[0] == 0
    _word_tokenizer(target, 512)
    rc, out, err = cli(capsys, "generate", "--artifacts", host_artifacts, "--target", target, "--prompt", "w7 w300",
                       "--max-new-tokens", "4")
    assert rc == 0, err


def test_encoded_ids_are_checked_against_the_vocabulary(host_artifacts, target_dir, tmp_path):
    """A codec swapped in after the load (no load-time check) still cannot pass an id past the vocabulary."""
    from dflash_iree.runtime.text import TextCodec

    target = _copy(target_dir, tmp_path / "target")
    _word_tokenizer(target, 512, ("<zzz>",))
    engine = Engine.load(host_artifacts)
    engine.codec = TextCodec(target)
    with pytest.raises(DFlashError, match=r"the prompt as .*/tokenizer.json encodes it: token id 512 \(position 1\) "
                                          r"is outside the vocabulary"):
        engine.generate("w7 <zzz>", 4)


# -- checkpoints ------------------------------------------------------------------------------

def _header_length(path: Path, n: int) -> None:
    path.write_bytes(n.to_bytes(8, "little") + path.read_bytes()[8:])


def _header_text(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[:8] + b"#" + data[9:])


SAFETENSORS_FAULTS = [
    ("cut-mid-tensor", lambda p: _cut(p, 0.6), ["not a whole safetensors file", "it was cut off"]),
    ("header-length-past-end", lambda p: _header_length(p, 2**40), ["header length 1099511627776 runs past"]),
    ("empty-file", lambda p: p.write_bytes(b""), ["0 bytes, shorter than the 8-byte header length"]),
    ("header-not-json", _header_text, ["the header is not JSON"]),
]


@pytest.mark.parametrize("damage,needles", [c[1:] for c in SAFETENSORS_FAULTS], ids=[c[0] for c in SAFETENSORS_FAULTS])
def test_damaged_safetensors_named_before_iree(capsys, host_artifacts, target_dir, tmp_path, damage, needles):
    target = _copy(target_dir, tmp_path / "target")
    damage(target / "model.safetensors")
    before = snapshot(target), snapshot(host_artifacts)
    rc, _, err = _generate(capsys, host_artifacts, "--target", target)
    assert_refused(rc, err, f"{target}/model.safetensors", *needles)
    assert (snapshot(target), snapshot(host_artifacts)) == before


def _edit_config(folder: Path, **changes) -> Path:
    cfg = json.loads((folder / "config.json").read_text())
    for key, value in changes.items():
        if key == "target_layer_ids":
            cfg["dflash_config"][key] = value
        elif key == "mask_token_id":
            cfg["dflash_config"][key] = value
        elif key == "rope_theta" and "rope_parameters" in cfg:
            cfg["rope_parameters"]["rope_theta"] = value
        else:
            cfg[key] = value
    (folder / "config.json").write_text(json.dumps(cfg))
    return folder


@pytest.mark.parametrize("scope,changes,needle", [
    ("target", {"rope_theta": 500000.0}, "target rope_theta: 500000.0 in"),
    ("target", {"rms_norm_eps": 1e-5}, "target rms_norm_eps: 1e-05 in"),
    ("drafter", {"mask_token_id": 3}, "drafter mask_token_id: 3 in"),
    ("drafter", {"target_layer_ids": [1, 3]}, "drafter target_layer_ids: [1, 3] in"),
], ids=["target-rope", "target-eps", "drafter-mask-id", "drafter-taps"])
def test_checkpoint_config_that_differs_from_the_manifest(capsys, host_artifacts, target_dir, drafter_dir, tmp_path,
                                                          scope, changes, needle):
    """Same parameter shapes, another model: the parsed config fields are compared, by name."""
    folder = _edit_config(_copy(target_dir if scope == "target" else drafter_dir, tmp_path / scope), **changes)
    before = snapshot(folder), snapshot(host_artifacts)
    rc, _, err = _generate(capsys, host_artifacts, f"--{scope}", folder)
    assert_refused(rc, err, "the checkpoints do not fit", needle, "in the manifest", "dflash-iree compile --arch host --target")
    assert (snapshot(folder), snapshot(host_artifacts)) == before


def test_checkpoint_with_another_config_hash_but_the_same_fields_binds(capsys, host_artifacts, target_dir, tmp_path):
    """An unrelated config field (the raw hash differs) does not stop one artifact serving it."""
    folder = _edit_config(_copy(target_dir, tmp_path / "t"), _name_or_path="elsewhere/qwen3-finetune")
    rc, out, err = _generate(capsys, host_artifacts, "--target", folder, "--json")
    assert rc == 0, err


def test_drafter_trained_for_another_block_size_warns(capsys, host_artifacts, drafter_dir, tmp_path):
    """Exact output, lower τ: a warning line with the consequence and the fix, exit 0."""
    rc, want, _ = _generate(capsys, host_artifacts, "--json")
    folder = _edit_config(_copy(drafter_dir, tmp_path / "d16"), block_size=16)
    rc, out, err = _generate(capsys, host_artifacts, "--drafter", folder, "--json")
    assert rc == 0 and json.loads(out)["tokens"] == json.loads(want)["tokens"]
    assert f"dflash-iree: warning: drafter {folder} was trained for block_size 16" in err
    assert "the output is exact" in err and "τ" in err and "Traceback" not in err


def test_drafter_without_config_json(capsys, host_artifacts, drafter_dir, tmp_path):
    folder = _copy(drafter_dir, tmp_path / "d")
    (folder / "config.json").unlink()
    before = snapshot(folder), snapshot(host_artifacts)
    rc, _, err = _generate(capsys, host_artifacts, "--drafter", folder)
    assert_refused(rc, err, f"{folder}/config.json does not exist")
    assert (snapshot(folder), snapshot(host_artifacts)) == before


def test_out_of_device_memory_names_bytes_and_a_context_that_fits(host_artifacts, monkeypatch):
    import iree.runtime as rt

    def exhausted(*a, **k):
        raise RuntimeError("Error creating context: RESOURCE_EXHAUSTED; failed to allocate 1234 bytes")

    state, params = guard.memory_needed(Manifest.load(host_artifacts / "manifest.json"))
    free = int((params + state // 2) / 0.8) + 8  # room for half the caches and the working fifth: max_context 128
    monkeypatch.setattr(rt, "VmContext", exhausted)
    monkeypatch.setattr(guard, "_available_bytes", lambda driver: free)
    with pytest.raises(DFlashError, match=rf"out of device memory with .*: the KV caches need {state / 2**20:.1f} MiB "
                                          rf"at max_context 256 and the weights {params / 2**20:.1f} MiB, "
                                          rf"{free / 2**20:.1f} MiB are free; recompile with --max-context 128 or less "
                                          rf"\(IREE: Error creating"):
        Engine.load(host_artifacts)


HUGE_CONTEXT = 2**21  # 3 GiB of KV caches for the tiny shapes (f32)


@pytest.fixture(scope="module")
def huge_artifacts(tmp_path_factory):
    """The tiny pair compiled with a KV cache of HUGE_CONTEXT rows (the module is as small as ever:
    the caches are allocated when it loads)."""
    from tiny import make_drafter, make_target

    from dflash_iree.export.compile import Progress, compile_artifacts

    folder = tmp_path_factory.mktemp("huge")
    target = make_target(folder / "target", max_position_embeddings=HUGE_CONTEXT)
    drafter = make_drafter(folder / "drafter", target)
    compile_artifacts("host", target, drafter, folder / "host", max_context=HUGE_CONTEXT,
                      log=Progress(open(os.devnull, "w")))
    return folder / "host"


@pytest.mark.skipif(not shutil.which("prlimit"), reason="needs prlimit")
def test_real_out_of_memory_at_load(huge_artifacts):
    """A process limited to 2.5 GB of address space cannot allocate 3 GiB of caches: IREE's
    RESOURCE_EXHAUSTED becomes one line with the MiB needed and free and a --max-context."""
    r = subprocess.run(["prlimit", f"--as={2500 * 2**20}", sys.executable, "-m", "dflash_iree", "generate",
                        "--artifacts", str(huge_artifacts), "--prompt-ids", "1 2 3", "--max-new-tokens", "4"],
                       capture_output=True, text=True, timeout=300)
    assert_refused(r.returncode, r.stderr, f"out of device memory with {huge_artifacts}: the KV caches need 3072.0 MiB "
                   f"at max_context {HUGE_CONTEXT}", "MiB are free; recompile with --max-context", "RESOURCE_EXHAUSTED")
