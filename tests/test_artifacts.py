"""Compiled artifacts and their checkpoints on the host CPU: the manifest (its arch and driver, old
formats refused with the fix), checkpoints found after moving them with the artifacts, and
checkpoints that do not fit (swapped, a missing or misshapen key, another dtype), each refused
naming the fix."""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file
from test_exactness import PROMPTS

from dflash_iree.errors import DFlashError
from dflash_iree.manifest import Manifest
from dflash_iree.runtime.artifacts import Artifacts
from dflash_iree.runtime.engine import Engine


@pytest.fixture(scope="module")
def engine(host_artifacts):
    return Engine.load(host_artifacts)


def test_arch_device_mismatch_refused(host_artifacts, tmp_path):
    arts = shutil.copytree(host_artifacts, tmp_path / "sm89")
    m = json.loads((arts / "manifest.json").read_text())
    m["arch"], m["driver"] = "sm_89", "cuda"
    (arts / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(DFlashError, match="compiled for sm_89, which runs on the 'cuda' driver, not on 'hip'"):
        Engine.load(arts, device="hip")
    m["arch"], m["driver"] = "host", "hip"  # the driver is the manifest's, not worked out from the arch
    (arts / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(DFlashError, match="compiled for host, which runs on the 'hip' driver, not on 'local-task'"):
        Engine.load(arts, device="local-task")


def test_old_manifests_are_refused_with_the_fix(host_artifacts, tmp_path):
    """A manifest of another format_version, or one missing a field, is refused naming the fix
    (recompile), not read key by key until something breaks."""
    arts = shutil.copytree(host_artifacts, tmp_path / "old")
    good = json.loads((arts / "manifest.json").read_text())
    fix = r"recompile with dflash-iree compile --arch host --target DIR --drafter DIR --out .*old"
    for change, match in (({"format_version": 1}, r"format_version 1 is not 2"),
                          ({"driver": "vulkan"}, r"driver 'vulkan' is not one of local-task, cuda, hip")):
        (arts / "manifest.json").write_text(json.dumps({**good, **change}))
        with pytest.raises(DFlashError, match=match + ".*" + fix):
            Artifacts.load(arts)
    (arts / "manifest.json").write_text(json.dumps({k: v for k, v in good.items() if k not in ("driver", "kv_page")}))
    with pytest.raises(DFlashError, match=r"manifest\.json has no driver, kv_page \(written by an older dflash-iree\); " + fix):
        Artifacts.load(arts)
    (arts / "manifest.json").write_text("{not json")
    with pytest.raises(DFlashError, match=r"is not valid JSON"):
        Artifacts.load(arts)


def test_checkpoints_found_after_moving_with_the_artifacts(engine, host_artifacts, target_dir, drafter_dir, tmp_path):
    """Artifacts copied elsewhere together with their checkpoints (the same layout) load without
    target/drafter through the manifest's folder_relative, the absolute folders gone; a manifest
    with absolute folders only (written before folder_relative) still loads; a recorded folder
    found nowhere is refused naming the manifest fields and --target; so is a missing --target."""
    common = Path(os.path.commonpath([host_artifacts, target_dir, drafter_dir]))
    for folder in (host_artifacts, target_dir, drafter_dir):
        shutil.copytree(folder, tmp_path / folder.relative_to(common))
    moved = tmp_path / host_artifacts.relative_to(common)
    m = json.loads((moved / "manifest.json").read_text())
    for scope in ("target", "drafter"):
        m[scope]["folder"] = str(tmp_path / "gone" / scope)
    (moved / "manifest.json").write_text(json.dumps(m))
    arts = Artifacts.load(moved)
    assert arts.checkpoint_folder("target").resolve() == (tmp_path / target_dir.relative_to(common)).resolve()
    assert arts.checkpoint_folder("drafter").resolve() == (tmp_path / drafter_dir.relative_to(common)).resolve()
    assert Engine.load(moved).generate(PROMPTS[0], 12).tokens == engine.generate(PROMPTS[0], 12).tokens

    old = {**m, "target": {**m["target"], "folder": str(target_dir)}}
    del old["target"]["folder_relative"]
    assert Artifacts(moved, Manifest.from_json(old)).checkpoint_folder("target") == Path(target_dir)

    shutil.rmtree(tmp_path / target_dir.relative_to(common))
    with pytest.raises(DFlashError, match=r"the target checkpoint recorded in .*manifest\.json does not exist "
                                          r"\(neither target\.folder_relative \.\./.* nor target\.folder .*gone/target\); "
                                          r"pass --target DIR"):
        Engine.load(moved)
    with pytest.raises(DFlashError, match=r"target checkpoint folder .*nowhere \(--target\) does not exist"):
        Engine.load(moved, target=str(tmp_path / "nowhere"))
    shutil.rmtree(tmp_path / drafter_dir.relative_to(common))
    with pytest.raises(DFlashError, match=r"(?s)the target checkpoint recorded .*\n.*the drafter checkpoint recorded"):
        Engine.load(moved)  # both missing folders in one message


def test_swapped_checkpoints_are_named(host_artifacts, target_dir, drafter_dir):
    """Target and drafter passed the wrong way round, or one folder for both: one line naming the
    folder by its config.json, before any tensor is compared."""
    arts = Artifacts.load(host_artifacts)
    cases = ((drafter_dir, target_dir, "look swapped; pass them the other way round"),
             (target_dir, target_dir, "its config.json is a target's, not a DFlash drafter's"),
             (drafter_dir, drafter_dir, "its config.json is a DFlash drafter's; pass the target's folder"))
    for target, drafter, want in cases:
        with pytest.raises(DFlashError) as e:
            arts.bind(None, target=str(target), drafter=str(drafter))
        assert want in str(e.value) and len(str(e.value).splitlines()) == 1


def test_checkpoint_mismatch_lists_every_key(host_artifacts, target_dir, tmp_path):
    bad = shutil.copytree(target_dir, tmp_path / "t")
    tensors = load_file(str(bad / "model.safetensors"))
    del tensors["model.layers.0.mlp.up_proj.weight"]
    tensors["model.norm.weight"] = tensors["model.norm.weight"][:10].clone()
    save_file(tensors, str(bad / "model.safetensors"))
    with pytest.raises(DFlashError) as e:
        Engine.load(host_artifacts, target=str(bad))
    assert "model.layers.0.mlp.up_proj.weight: missing" in str(e.value)
    assert "model.norm.weight: expected shape [64], found [10]" in str(e.value)


def test_dtype_only_mismatch_names_the_compile_flag(host_artifacts, target_dir, tmp_path):
    bad = shutil.copytree(target_dir, tmp_path / "t16")
    tensors = {k: v.half() for k, v in load_file(str(bad / "model.safetensors")).items()}
    save_file(tensors, str(bad / "model.safetensors"))
    with pytest.raises(DFlashError, match="recompile with --dtype f16, or convert the checkpoints to f32") as e:
        Engine.load(host_artifacts, target=str(bad))
    assert str(e.value).count("recompile with") == 1
