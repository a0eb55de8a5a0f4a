"""DFlash2 checkpoints that cannot be served: one line each, exit status 2 from the CLI, nothing
written (dflash_iree/dflash2.py). The v1 refusals (tests/test_config.py) apply to DFlash2 too."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from badinput import assert_refused, cli, snapshot
from safetensors.torch import load_file, save_file

from dflash_iree.config import load_drafter_config, load_target_config
from dflash_iree.errors import DFlashError
from dflash_iree.export.load import load_pair


def _copy(src, dst, config=None, tensors=None):
    d = shutil.copytree(src, dst)
    if config:
        cfg = json.loads((d / "config.json").read_text())
        config(cfg)
        (d / "config.json").write_text(json.dumps(cfg))
    if tensors:
        t = load_file(str(d / "model.safetensors"))
        tensors(t)
        save_file(t, str(d / "model.safetensors"))
    return d


def test_dflash2_fields_are_read(target_dir, dflash2_dir):
    cfg = load_drafter_config(dflash2_dir, load_target_config(target_dir))
    assert (cfg.dflash2.conv_kernel_size, cfg.dflash2.conv_group_size, cfg.dflash2.selector_rank,
            cfg.dflash2.selector_top_k) == (2, 16, 8, 16)
    _, drafter = load_pair(target_dir, dflash2_dir, 64)
    keys = set(dict(drafter.named_parameters()))
    assert {"layers.1.attention_conv.base_kernel", "layers.0.mlp_conv.kernel_projection.weight",
            "candidate_selector.hidden_projection.weight", "candidate_selector.predecessor_codebook",
            "candidate_selector.successor_codebook"} <= keys
    assert len(keys) == 3 + 11 * 2 + 4 * 2 + 3


CONFIG_REFUSALS = {
    "top-k-above-dispatch": (lambda c: c["dflash_config"].update(selector_top_k=65),
                             "selector_top_k 65 is above 64, the most candidates the draft top-K dispatch"),
    "missing-rank": (lambda c: c["dflash_config"].pop("selector_rank"), "dflash_config.selector_rank is missing"),
    "group-not-dividing": (lambda c: c["dflash_config"].update(conv_group_size=24),
                           "conv_group_size 24 does not divide hidden_size 64"),
    "rank-not-integer": (lambda c: c["dflash_config"].update(selector_rank="8"), "selector_rank is '8'"),
    "softcap-negative": (lambda c: c["dflash_config"].update(final_logit_softcapping=-1),
                         "final_logit_softcapping is -1"),
    "v1-refusal-applies": (lambda c: c.update(hidden_size=32), "hidden_size is 32 in the drafter but 64"),
}

TENSOR_REFUSALS = {
    "missing-codebook": (lambda t: t.pop("candidate_selector.successor_codebook"),
                         "tensor candidate_selector.successor_codebook is missing"),
    "codebook-with-weight-suffix": (
        lambda t: t.update({"candidate_selector.predecessor_codebook.weight": t.pop("candidate_selector.predecessor_codebook")}),
        "without the .weight suffix"),
    "codebook-of-another-vocabulary": (
        lambda t: t.update({"candidate_selector.predecessor_codebook": torch.zeros(600, 8)}),
        "600 rows, but the target's vocabulary has 512 tokens"),
    "missing-hidden-projection": (lambda t: t.pop("candidate_selector.hidden_projection.weight"),
                                  "tensor candidate_selector.hidden_projection.weight is missing"),
}


@pytest.mark.parametrize("case", CONFIG_REFUSALS, ids=CONFIG_REFUSALS.keys())
def test_config_refusals(capsys, target_dir, dflash2_dir, tmp_path, case):
    edit, needle = CONFIG_REFUSALS[case]
    d = _copy(dflash2_dir, tmp_path / "d", config=edit)
    with pytest.raises(DFlashError, match=needle.replace("(", r"\(")):
        load_drafter_config(d, load_target_config(target_dir))
    out = tmp_path / "out"
    rc, _, err = cli(capsys, "compile", "--arch", "host", "--target", target_dir, "--drafter", d, "--out", out)
    assert_refused(rc, err, needle)
    assert err.strip().count("\n") == 0 and snapshot(out) is None


@pytest.mark.parametrize("case", TENSOR_REFUSALS, ids=TENSOR_REFUSALS.keys())
def test_tensor_refusals(capsys, target_dir, dflash2_dir, tmp_path, case):
    edit, needle = TENSOR_REFUSALS[case]
    d = _copy(dflash2_dir, tmp_path / "d", tensors=edit)
    before = snapshot(d)
    rc, _, err = cli(capsys, "eager", "--target", target_dir, "--drafter", d, "--prompt-ids", "1 2 3",
                     "--max-new-tokens", "4")
    assert_refused(rc, err, needle)
    assert err.strip().count("\n") == 0
    assert snapshot(d) == before
