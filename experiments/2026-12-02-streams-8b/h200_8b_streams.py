"""On the H200: the Qwen3-8B-shaped pair's step costs at one and four streams, for issue #29's 8B goals.

    bash bench/on_device.sh python3 experiments/2026-12-02-streams-8b/h200_8b_streams.py --json "$OUT/streams_8b_h200.json"

Random bf16 weights made on the GPU (bench/speed_8b.py `_build`), bound into both modules
(.gpu/8b-b8-s1-sm_80 and .gpu/8b-b8-s4-sm_80, prepare.py; --s1 and --s4 name other folders there).
Each stream is prefilled with a 512-token prompt; then, alternated ROUNDS times in this one process:
- s1: `decode` (one synchronous call, as a 4-stream plain step is), `decode_ahead` per token (the
  runtime's one-stream plain decoding), `verify_draft` (one DFlash round, block 8);
- s4: `decode` of all four streams, `verify_draft` of all four streams, `verify_draft` with one
  stream active and three idle (what 1-stream DFlash cost on the 4-stream module before its
  one-stream form), and the one-stream form's `decode_stream` and `verify_draft_stream` (what the
  engine calls when one stream runs).
The projection (project.py) replays the demo pair's recorded acceptance sequences over these costs.
"""

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

from common import summary, times  # noqa: E402
import speed_8b  # noqa: E402

PROMPT = 512
GREEDY = (0.0, 0, 1.0, 0)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", required=True)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--s1", default="8b-b8-s1-sm_80", help="the one-stream module's folder in .gpu/")
    ap.add_argument("--s4", default="8b-b8-s4-sm_80", help="the four-stream module's folder in .gpu/")
    args = ap.parse_args()
    import iree.runtime as rt
    import torch

    from dflash_iree.runtime.artifacts import Artifacts
    from dflash_iree.runtime.stream_calls import StreamCalls

    target, drafter = speed_8b._build(torch)
    keep: list = []
    indexes = speed_8b._indexes(target, drafter, keep)
    del target, drafter
    torch.cuda.empty_cache()
    device = rt.get_device("cuda")
    prompt = [(7 * i + 3) % 1000 + 10 for i in range(PROMPT)]
    out = {"prompt_tokens": PROMPT, "gpu": torch.cuda.get_device_name(), "samples": {}}

    def load(name: str):
        arts = Artifacts.load(ROOT / ".gpu" / name)
        pair = arts.bind_indexes(device, indexes)
        return arts, pair

    a1, p1 = load(args.s1)
    B = a1.block_size
    first, taps = p1.prefill(prompt)
    p1.absorb(taps)
    a4, p4 = load(args.s4)
    calls = StreamCalls(p4, 4)
    for s in range(4):
        _, t = calls.prefill(s, prompt, GREEDY)
        calls.absorb(s, t)
    out["s1"] = {"artifact": a1.folder.name, "dispatches_per_call": a1.manifest.stats["dispatches_per_call"]}
    out["s4"] = {"artifact": a4.folder.name, "dispatches_per_call": a4.manifest.stats["dispatches_per_call"]}
    block = [first] + [11 + i for i in range(B - 1)]
    starts4 = [PROMPT] * 4

    steps = {
        "s1_decode": lambda: p1.decode(first, PROMPT),
        "s1_decode_ahead_per_token": None,
        "s1_verify_draft": lambda: p1.verify_draft(block, PROMPT),
        "s4_decode": lambda: calls.decode([first] * 4, starts4, [GREEDY] * 4),
        "s4_verify_draft": lambda: calls.verify_draft([block] * 4, starts4, [B - 1] * 4, [GREEDY] * 4),
        "s4_verify_draft_one_active": lambda: calls.verify_draft([block] + [[0] * B] * 3, [PROMPT, 0, 0, 0],
                                                                 [B - 1, 0, 0, 0], [GREEDY] * 4),
        # the one-stream form (export/stream_entry_points.py), what the engine calls when one stream runs
        "s4_decode_one_stream": lambda: calls.decode([first] + [0] * 3, starts4, [GREEDY] * 4, only=0),
        "s4_verify_draft_one_stream": lambda: calls.verify_draft([block] + [[0] * B] * 3, [PROMPT, 0, 0, 0],
                                                                 [B - 1, 0, 0, 0], [GREEDY] * 4, only=0),
    }

    def ahead():
        for _ in p1.decode_ahead(first, PROMPT, 64):
            pass

    samples = {k: [] for k in steps}
    for r in range(args.rounds):
        for name, fn in steps.items():
            if fn is None:
                ms = [m / 64 for m in times(ahead, 6, warmup=1)]
            else:
                ms = times(fn, 32)
            samples[name] += ms
            print(f"round {r} {name}: median {statistics.median(ms):.3f} ms", flush=True)
    out["steps"] = {k: summary(v) for k, v in samples.items()}
    Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps(out["steps"], indent=1))


if __name__ == "__main__":
    main()
