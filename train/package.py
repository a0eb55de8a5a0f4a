"""Turn the device's weight files into the committed checkpoint folders (CPU).

    .venv/bin/python train/package.py --weights .train-out --models models/demo --default-block 8

The device writes weights only (its $OUT takes 8 files); this adds what makes them checkpoints:
- models/demo/target/: config.json (Qwen3ForCausalLM), generation_config.json, tokenizer.json,
  tokenizer_config.json, and the bf16 safetensors (shards + index) as the device wrote them;
- models/demo/drafter/: the drafter of --default-block, in the published DFlash format
  (config.json with dflash_config, model.safetensors); models/demo/drafter-b{B}/ for the others.
Configs come from train/common.py, the same dicts the training used.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

from common import drafter_config_dict, generation_config_dict, target_config_dict


def write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2) + "\n")


def copy_weights(src: Path, dst: Path) -> None:
    """Replace dst's safetensors files (and index) with src's."""
    dst.mkdir(parents=True, exist_ok=True)
    for old in list(dst.glob("*.safetensors")) + list(dst.glob("model.safetensors.index.json")):
        old.unlink()
    for f in sorted(src.iterdir()):
        if f.name.endswith(".safetensors") or f.name == "model.safetensors.index.json":
            shutil.copyfile(f, dst / f.name)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--weights", default=".train-out", help="the device's output folder (target/, drafter-b*/)")
    ap.add_argument("--data", default=".train-data", help="corpus.py output (tokenizer files)")
    ap.add_argument("--models", default="models/demo")
    ap.add_argument("--default-block", type=int, default=8, help="the drafter that becomes models/demo/drafter")
    args = ap.parse_args()
    src, models, data = Path(args.weights), Path(args.models), Path(args.data)

    if (src / "target").is_dir():  # a drafter-only run (train_drafter.py against the packaged target) has none
        target = models / "target"
        copy_weights(src / "target", target)
        write_json(target / "config.json", target_config_dict())
        write_json(target / "generation_config.json", generation_config_dict())
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copyfile(data / name, target / name)

    for folder in sorted(src.glob("drafter-b*")):
        block = int(folder.name.removeprefix("drafter-b"))
        dst = models / ("drafter" if block == args.default_block else f"drafter-b{block}")
        copy_weights(folder, dst)
        write_json(dst / "config.json", drafter_config_dict(block))
    for folder in sorted(src.glob("drafter-dflash2-b*")):  # train_drafter.py --dflash2: models/demo/drafter2
        block = int(folder.name.removeprefix("drafter-dflash2-b"))
        dst = models / ("drafter2" if block == args.default_block else f"drafter2-b{block}")
        copy_weights(folder, dst)
        write_json(dst / "config.json", drafter_config_dict(block, dflash2=True))
    total = sum(f.stat().st_size for f in models.rglob("*") if f.is_file())
    print(f"{models}: {total / 1e6:.1f} MB")


if __name__ == "__main__":
    main()
