"""Where a user meets the Qwen3.5 family's limits on the command line: one line, exit status 2,
nothing written. MoE (qwen3_5_moe), Qwen3-Next and a hybrid passed as the drafter (its MTP head)
are refused (tests/test_qwen35_compile.py compiles a hybrid, tests/test_qwen35_streams.py with several streams)."""

from __future__ import annotations

import json
import re
import warnings

import pytest
from tiny_qwen35 import make_hybrid

from dflash_iree.cli import main


@pytest.fixture(scope="module")
def hybrid_dir(tmp_path_factory):
    return make_hybrid(tmp_path_factory.mktemp("q35cli") / "text")


def _refused(capsys, argv, out, match):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        rc = main(["compile", *argv, "--out", str(out)])
    err = capsys.readouterr().err
    assert rc == 2 and "Traceback" not in err and re.search(match, err), err
    assert len(err.strip().splitlines()) == 1, err
    assert not out.exists()


@pytest.mark.parametrize("family, match", [("qwen3_5_moe", "mixture-of-experts targets are not implemented"),
                                           ("qwen3_next", "Qwen3-Next .* is not implemented")])
def test_compile_refuses_moe_and_next(capsys, tmp_path, hybrid_dir, drafter_dir, family, match):
    folder = tmp_path / family
    folder.mkdir()
    raw = json.loads((hybrid_dir / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**raw, "model_type": family}))
    _refused(capsys, ["--target", str(folder), "--drafter", str(drafter_dir)], tmp_path / "o", match)


def test_compile_refuses_a_hybrid_as_the_drafter(capsys, tmp_path, target_dir, hybrid_dir):
    _refused(capsys, ["--target", str(target_dir), "--drafter", str(hybrid_dir)], tmp_path / "o",
             "not a DFlash drafter .*MTP head is not supported as a drafter")
