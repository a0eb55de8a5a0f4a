"""Config and checkpoint reading: the fallback tap rule, block_size placement, sharding, refusals."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from tiny import make_drafter

from dflash_iree.checkpoint import check_tensors, index_checkpoint
from dflash_iree.config import build_target_layer_ids, load_drafter_config, load_target_config
from dflash_iree.errors import DFlashError
from dflash_iree.export.load import load_pair, load_target


def _edit_config(folder, **changes):
    path = folder / "config.json"
    cfg = json.loads(path.read_text())
    for k, v in changes.items():
        if v is None:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    path.write_text(json.dumps(cfg))


@pytest.fixture
def target_copy(target_dir, tmp_path):
    return shutil.copytree(target_dir, tmp_path / "target")


def test_target_config_fields(target_dir):
    cfg = load_target_config(target_dir)
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.head_dim, cfg.kv_dim) == (64, 4, 16, 32)
    assert cfg.rope_theta == 10000.0 and cfg.dtype == "f32" and not cfg.tie_word_embeddings


def test_published_fallback_tap_rule():
    assert build_target_layer_ids(36, 5) == [1, 9, 17, 25, 33]  # Qwen3-8B
    assert build_target_layer_ids(64, 5) == [1, 16, 31, 46, 61]  # Qwen3.5-27B
    assert build_target_layer_ids(4, 1) == [2]


def test_fallback_taps_warn(target_dir, tmp_path):
    d = make_drafter(tmp_path / "d", target_dir, taps=None, layers=2)
    with pytest.warns(UserWarning, match="fallback"):
        cfg = load_drafter_config(d, load_target_config(target_dir))
    assert cfg.target_layer_ids == (1, 1)  # 4 target layers: spread over 1..L-3 = 1..1


def test_block_size_in_either_place(target_dir, tmp_path):
    tcfg = load_target_config(target_dir)
    top = make_drafter(tmp_path / "top", target_dir, block_size=6)
    inner = make_drafter(tmp_path / "inner", target_dir, block_size=5, block_in_dflash_config=True)
    assert load_drafter_config(top, tcfg).block_size == 6
    assert load_drafter_config(inner, tcfg).block_size == 5


def test_sharded_checkpoint_equals_single(target_dir, tmp_path):
    sharded = shutil.copytree(target_dir, tmp_path / "sharded")
    tensors = load_file(str(sharded / "model.safetensors"))
    (sharded / "model.safetensors").unlink()
    keys = sorted(tensors)
    weight_map = {}
    for i, part in enumerate((keys[: len(keys) // 2], keys[len(keys) // 2:])):
        name = f"model-0000{i + 1}-of-00002.safetensors"
        save_file({k: tensors[k] for k in part}, str(sharded / name))
        weight_map.update({k: name for k in part})
    (sharded / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    assert len({i.file for i in index_checkpoint(sharded).values()}) == 2
    a, b = load_target(target_dir, 64), load_target(sharded, 64)
    tokens = torch.randint(0, 512, (1, 9))
    with torch.no_grad():
        assert torch.equal(a(tokens, torch.tensor([0]))[1], b(tokens, torch.tensor([0]))[1])


def test_unsupported_family_is_named(target_copy):
    _edit_config(target_copy, model_type="llama")
    with pytest.raises(DFlashError, match="model_type 'llama' is not supported; supported families: qwen3"):
        load_target_config(target_copy)


def test_missing_config(tmp_path):
    with pytest.raises(DFlashError, match="config.json does not exist"):
        load_target_config(tmp_path)


def test_rope_scaling_refused_by_name(target_copy):
    """YaRN is read (tests/test_yarn.py); other scaling types are refused by name."""
    _edit_config(target_copy, rope_parameters={"rope_type": "linear", "rope_theta": 1e6, "factor": 4.0})
    with pytest.raises(DFlashError, match=r"rope_parameters\.rope_type 'linear' is not implemented"):
        load_target_config(target_copy)
    _edit_config(target_copy, rope_parameters={"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0})
    assert load_target_config(target_copy).yarn.factor == 4.0


def test_missing_tensor_named(target_copy):
    tensors = load_file(str(target_copy / "model.safetensors"))
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, str(target_copy / "model.safetensors"))
    with pytest.raises(DFlashError, match=r"model.layers.1.mlp.up_proj.weight: missing \(expected shape \[128, 64\]\)"):
        load_target(target_copy, 64)


def test_misshaped_tensor_named(target_copy):
    tensors = load_file(str(target_copy / "model.safetensors"))
    tensors["model.norm.weight"] = torch.ones(63)
    save_file(tensors, str(target_copy / "model.safetensors"))
    with pytest.raises(DFlashError, match=r"model.norm.weight: expected shape \[64\], found \[63\]"):
        load_target(target_copy, 64)


def test_check_tensors_dtype(target_dir):
    with pytest.raises(DFlashError, match="expected dtype bf16, found f32"):
        check_tensors(target_dir, {"model.norm.weight": (64,)}, dtype="bf16")


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(hidden_size=32), "hidden_size is 32 in the drafter but 64 in the target"),
        (dict(vocab_size=1000), "vocab_size is 1000 in the drafter but 512 in the target"),
        (dict(num_target_layers=36), "num_target_layers is 36 in the drafter but num_hidden_layers=4 in the target"),
        (dict(dflash_config={"mask_token_id": 511, "target_layer_ids": [0, 4]}), r"target_layer_ids is \[0, 4\]"),
        (dict(dflash_config={"target_layer_ids": [0, 2]}), "mask_token_id is missing"),
        (dict(dflash_config={"mask_token_id": 1, "target_layer_ids": [0], "conv_kernel_size": 2}),
         "dflash_config.conv_group_size is missing; a DFlash2 drafter"),
        (dict(model_type="llama"), "model_type 'llama' is not supported"),
    ],
)
def test_drafter_refusals(target_dir, drafter_dir, tmp_path, change, message):
    d = shutil.copytree(drafter_dir, tmp_path / "d")
    _edit_config(d, **change)
    with pytest.raises(DFlashError, match=message):
        load_drafter_config(d, load_target_config(target_dir))


def test_target_given_as_drafter(target_dir, drafter_dir):
    with pytest.raises(DFlashError, match="this is a DFlash drafter config"):
        load_target_config(drafter_dir)


def test_a_target_given_as_the_drafter_is_named(target_dir):
    with pytest.raises(DFlashError, match="not a DFlash drafter config .*pass a Qwen3 or Qwen3.5-family model as the "):
        load_drafter_config(target_dir, load_target_config(target_dir))


def test_block_size_out_of_range(target_dir, drafter_dir):
    with pytest.raises(DFlashError, match=r"block_size 9 is out of range: use 2..8"):
        load_pair(target_dir, drafter_dir, 64, block_size=9)


def test_published_drafter_key_set(target_dir, drafter_dir):
    """3 + 11 * layers tensors, and no embedding or lm_head (the drafter uses the target's)."""
    _, drafter = load_pair(target_dir, drafter_dir, 64)
    keys = set(dict(drafter.named_parameters()))
    assert len(keys) == 3 + 11 * 2
    assert {"fc.weight", "hidden_norm.weight", "norm.weight", "layers.1.self_attn.k_norm.weight"} <= keys
    assert not any("embed" in k or "lm_head" in k for k in keys)
