"""Turn the device's weight files into the committed checkpoint folders (CPU).

    .venv/bin/python train/package.py --weights .train-out --models models/demo --default-block 8
    .venv/bin/python train/package.py --weights .train-out/q35 --models models/demo-qwen35

The device writes weights only (its $OUT takes 8 files); this adds what makes them checkpoints:
- MODELS/target/: config.json, generation_config.json, tokenizer.json, tokenizer_config.json, and
  the bf16 safetensors (shards + index) as the device wrote them;
- MODELS/drafter/: the drafter of --default-block, in the published DFlash format
  (config.json with dflash_config, model.safetensors); MODELS/drafter-b{B}/ for the others.
Configs come from train/common.py, the same dicts the training used: the target's is
`common.target_dict` of WEIGHTS/target (the Qwen3 demo target's when the folder has no
config.json, as train_target.py writes none; the hybrid's as train_target_qwen35.py wrote it), or,
for a drafter-only run, of the already packaged MODELS/target; the drafters' are
`common.drafter_config_dict` for that target (its depth sets the taps).
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

from common import drafter_config_dict, generation_config_dict, target_dict


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

    target = models / "target"
    # a drafter-only run (train_drafter.py against the packaged target) has no WEIGHTS/target
    tconfig = target_dict(src / "target" if (src / "target").is_dir() else target)
    if (src / "target").is_dir():
        copy_weights(src / "target", target)
        write_json(target / "config.json", tconfig)
        write_json(target / "generation_config.json", generation_config_dict())
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copyfile(data / name, target / name)

    for folder in sorted(src.glob("drafter-b*")):
        block = int(folder.name.removeprefix("drafter-b"))
        dst = models / ("drafter" if block == args.default_block else f"drafter-b{block}")
        copy_weights(folder, dst)
        write_json(dst / "config.json", drafter_config_dict(block, target=tconfig))
    for folder in sorted(src.glob("drafter-dflash2-b*")):  # train_drafter.py --dflash2: models/demo/drafter2
        block = int(folder.name.removeprefix("drafter-dflash2-b"))
        dst = models / ("drafter2" if block == args.default_block else f"drafter2-b{block}")
        copy_weights(folder, dst)
        write_json(dst / "config.json", drafter_config_dict(block, dflash2=True, target=tconfig))
    total = sum(f.stat().st_size for f in models.rglob("*") if f.is_file())
    print(f"{models}: {total / 1e6:.1f} MB")


if __name__ == "__main__":
    main()
