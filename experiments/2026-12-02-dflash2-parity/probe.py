"""Our DFlash2 forward against z-lab's own DFlash2DraftModel, on the same tiny random weights.

usage: python experiments/2026-12-02-dflash2-parity/probe.py ZLAB_CHECKOUT [--json OUT]

ZLAB_CHECKOUT is a scratch copy of github:z-lab/dflash (outside this repository, never committed)
whose dflash/model.py defines DFlash2DraftModel. The tiny target and DFlash2 drafter come from
tests/tiny.py (float32, a logit softcap and multiplier set so that the transform is compared too);
for several prompts and seeds it compares the normalised block output at the drafted rows, the
logits (after the transform), the top-16 candidate sets and the greedy walk's choices. Prints a
table and writes the JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("zlab", type=Path)
    ap.add_argument("--json", type=Path, default=Path(__file__).with_name("result.json"))
    args = ap.parse_args()
    sys.path.insert(0, str(args.zlab))
    from dflash.model import DFlash2DraftModel  # z-lab's
    from safetensors.torch import load_file
    from tiny import make_dflash2_drafter, make_target
    from transformers import Qwen3Config

    from dflash_iree.export.load import load_pair

    rows = []
    for seed in range(3):
        d = Path(tempfile.mkdtemp())
        t = make_target(d / "target", seed=seed)
        dd = make_dflash2_drafter(d / "drafter2", t, seed=seed, output_multiplier=1.0)
        cfg = json.loads((dd / "config.json").read_text())
        cfg["dflash_config"].update(output_multiplier=0.7, final_logit_softcapping=8.0)
        (dd / "config.json").write_text(json.dumps(cfg))
        target, ours = load_pair(t, dd, 128)
        zcfg = Qwen3Config(**{k: v for k, v in cfg.items() if k not in ("architectures",)})
        zcfg.dflash_config = cfg["dflash_config"]
        zcfg._attn_implementation = "sdpa"
        theirs = DFlash2DraftModel(zcfg).eval()
        weights = load_file(str(dd / "model.safetensors"))
        weights = {(k + ".weight" if k.endswith("_codebook") else k): v for k, v in weights.items()}
        missing, unexpected = theirs.load_state_dict(weights, strict=False)
        assert not unexpected and all("rotary" in m for m in missing), (missing, unexpected)
        B = ours.block_size
        for n_prompt in (5, 23):
            g = torch.Generator().manual_seed(100 * seed + n_prompt)
            prompt = torch.randint(0, 512, (1, n_prompt + 1), generator=g)
            with torch.no_grad():
                _, _, taps = target(prompt[:, :-1], torch.tensor([0]))
                anchor = prompt[:, -1]
                ours.absorb(taps[:, :0], torch.tensor([0]))
                ours.ctx_cache.zero_()
                draft, logits = ours(target, taps, torch.tensor([0]), torch.tensor([n_prompt]), anchor)
                block = torch.cat([anchor[:, None], torch.full((1, B - 1), 511)], 1)
                noise = target.model.embed_tokens(block)
                pos = torch.arange(n_prompt + B)[None]
                hz = theirs(position_ids=pos, noise_embedding=noise, target_hidden=taps)[:, 1:]
                zdraft, zcand, _ = theirs.propose(hz, anchor, target.lm_head, 0.0)
                zlogits = theirs.compute_logits(hz, target.lm_head)
                cand, _ = ours.candidate_selector.candidates(logits)
            rows.append(dict(
                seed=seed, prompt_len=n_prompt,
                max_abs_logit_diff=float((logits[0] - zlogits[0]).abs().max()),
                top16_sets_equal=all(set(cand[0, i].tolist()) == set(zcand[0, i].tolist()) for i in range(B - 1)),
                walk_equal=draft[0].tolist() == zdraft[0].tolist(),
                walk_differs_from_argmax=draft[0].tolist() != logits[0].argmax(-1).tolist(),
                ours=draft[0].tolist(), zlab=zdraft[0].tolist()))
    print(f"{'seed':>4} {'P':>3} {'max|dlogit|':>12} {'top16 sets':>10} {'walk':>6} {'walk!=argmax':>12}")
    for r in rows:
        print(f"{r['seed']:>4} {r['prompt_len']:>3} {r['max_abs_logit_diff']:>12.2e} {str(r['top16_sets_equal']):>10} "
              f"{str(r['walk_equal']):>6} {str(r['walk_differs_from_argmax']):>12}")
    args.json.write_text(json.dumps({"zlab": str(args.zlab), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
