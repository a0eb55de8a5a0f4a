"""Train DFlash drafters (block 8 and 16) against a frozen demo target (the device script of stage 2).

    python3 train/train_drafter.py --data .train-data --target $OUT/target --out $OUT --seed 0

The target is built from --target's config.json (`common.target_dict`): `export.qwen3.Qwen3` for
model_type qwen3 (the 6-layer demo target; train_target.py writes no config.json, which means this
one), `export.qwen35.Qwen35` for qwen3_5_text (the 8-layer hybrid demo target of
train_target_qwen35.py). The taps are `common.tap_layers` of its depth, every other layer counted
back from the last: [1, 3, 5] of the 6-layer target, [1, 3, 5, 7] of the hybrid. For the hybrid
that is the same rule as the shipped pair (not [1, 4, 7]): it taps both gated attention layers (3,
7) and two Gated DeltaNet layers (1, 5), and keeps the last layer (the final-norm state), which
`target_logits` needs; one more tap costs the drafter only fc's 384 extra input columns.

1. Data: the drafter must predict what the *target* will say, so it learns from the target's own
   continuations (--new-tokens each, KV-cached target, prompts batched): greedy, and with --sampled F that fraction of the batches sampled at T = 1
   (what the target says when a request samples). Half the prompts are function headers + docstrings of the train files
   (the form of bench/prompts/code.jsonl), half random windows of the train stream. Labels after
   a generated <|endoftext|> are void (decoding stops there). The held-out files' function
   prompts, continued the same way, measure progress.
   A Qwen3 target batches prompts of different lengths (right-padded; the KV cache's pad rows are
   overwritten before they are seen). A hybrid target cannot: its DeltaNet state would absorb the
   pad tokens for good. So for it every generation batch has prompts of one length
   (`equal_length_groups`: each batch split by length, a prompt cut from the left by at most
   --max-cut of its length, keeping its end), and the function-prompt batches are sorted by
   length first (`sort_function_batches`) so that few groups result. train/check_greedy.py checks
   that batched greedy continuation equals one prompt at a time for both targets.
2. Taps: one cache-free target forward over each pooled sequence gives the taps (outputs of
   decoder layers TAP_LAYERS), kept on the GPU.
3. Training: per step, --batch sequences and --anchors random anchors in each sequence's
   generated part; drafter_forward.block_logits runs all blocks at once, loss = cross-entropy at
   block positions 1..B-1 weighted by exp(-(k-1)/gamma), mixed with --soft-weights w of the
   cross-entropy against the target's own distribution at those positions (its logits are the lm_head
   of the last tap, the final-norm hidden state; drafter_forward.block_loss). Every drafter (each
   block size, times each soft weight) trains in the same loop on the same sequences, each with
   its own AdamW.
Writes OUT/drafter-b{B}/model.safetensors (OUT/drafter-b{B}-soft{w}/ with more than one weight) (bf16, step in metadata) at every eval and the log
OUT/drafter_log.json. --resume DIR continues from such folders (Adam moments start fresh).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch

from dflash_iree.config_qwen35 import HybridConfig
from dflash_iree.export.dflash2 import drafter_class
from dflash_iree.export.qwen3 import Qwen3
from dflash_iree.export.qwen35 import Qwen35

from common import (EOS_ID, adamw, file_metadata, init_dflash2, init_weights, load_tensors, lr_at, optimizer_step,
                    param_state, parse_configs, save_sharded, tap_layers, target_dict, train, use_sdpa)
from drafter2_forward import block_logits2, selector_loss
from drafter_forward import block_logits, block_loss

# Position weight exp(-(k-1)/gamma): about the chance that position k is reached at all when
# each draft is accepted with probability ~0.8 (0.8**(k-1) = exp(-(k-1)/4.5)).
GAMMA = {8: 4.0, 16: 5.0}


def frozen_target(folder: Path, dtype: torch.dtype, device):
    """The frozen target of a weights folder, built from its config.json (`common.target_dict`)
    through the project's config readers, tapping `common.tap_layers` of its depth.

    Returns (make_target(streams, context) -> a fresh eval-mode Qwen3 or Qwen35 with the weights in
    `dtype` and a cache of that shape, the config dict, the parsed TargetConfig / HybridConfig).
    """
    tconfig = target_dict(folder)
    tcfg, _ = parse_configs(target=tconfig)
    taps = tap_layers(tcfg.num_hidden_layers)
    weights = {k: v.to(dtype) for k, v in load_tensors(folder).items()}

    def make_target(streams: int, context: int) -> Qwen3 | Qwen35:
        # the KV cache's shape fixes the generation batch and length, hence one module per batch
        if isinstance(tcfg, HybridConfig):
            # one state slot: generation runs a prefill (which keeps its last state) and then one
            # token per call, never rolling back; 16 slots of 4096 streams would take ~38 GB
            t = Qwen35(tcfg, context, taps, streams=streams, dtype=dtype, device=device, attention="fused",
                       state_slots=1)
        else:
            t = Qwen3(tcfg, context, taps, streams=streams, dtype=dtype, device=device)
        missing, unexpected = t.load_state_dict(weights, strict=False)
        if unexpected or any(not k.endswith("lm_head.weight") for k in missing):  # lm_head is tied
            raise SystemExit(f"{folder}: the weights do not fit its {tconfig['model_type']} config: "
                             f"missing {missing[:4]}, unexpected {unexpected[:4]}")
        return t.requires_grad_(False).eval()

    return make_target, tconfig, tcfg


def load_prompt_set(path: Path) -> list[torch.Tensor]:
    """corpus.py's prompt .npz -> list of int64 token tensors (CPU)."""
    z = np.load(path)
    tokens, offsets = torch.from_numpy(z["tokens"].astype(np.int64)), z["offsets"]
    return [tokens[offsets[i]:offsets[i + 1]] for i in range(len(offsets) - 1)]


@torch.no_grad()
def greedy_batch(make_target, prompts: list[torch.Tensor], new_tokens: int, device,
                 gen: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Continue prompts of different lengths greedily (or, with `gen`, sampled at T = 1 from it),
    all streams at once.

    Prompts are right-padded to the longest (T) and prefilled together; stream s then decodes at
    its own positions len_s, len_s + 1, ... (`start` is per stream). Pad rows in the KV cache sit
    at positions >= len_s, which the causal mask hides until decoding overwrites them. That holds
    for a KV cache only: a hybrid target's recurrent state after the prefill has absorbed the pad
    rows, so its prompts must all have one length (`equal_length_groups`).

    Returns:
        seq int64 [S, T + new_tokens]: prompt, then the continuation, then padding (EOS_ID);
        lens int64 [S]: the prompt lengths.
    """
    S = len(prompts)
    lens = torch.tensor([len(p) for p in prompts], device=device)
    T = int(lens.max())
    x = torch.full((S, T), EOS_ID, dtype=torch.int64)
    for i, p in enumerate(prompts):
        x[i, :len(p)] = p
    x = x.to(device)
    target = make_target(S, T + new_tokens)

    rows = torch.arange(S, device=device)

    def pick(chosen, logits, at):  # the token after row `at` of each stream
        if gen is None:
            return chosen[rows, at]
        probs = torch.softmax(logits[rows, at].float(), -1)
        return torch.multinomial(probs, 1, generator=gen)[:, 0]

    out = [pick(*target(x, torch.zeros(S, dtype=torch.int64, device=device), read_len=T)[:2], lens - 1)]
    for i in range(1, new_tokens):
        out.append(pick(*target(out[-1][:, None], lens + i - 1, read_len=T + i)[:2], 0))
    seq = torch.full((S, T + new_tokens), EOS_ID, dtype=torch.int64, device=device)
    seq[:, :T] = x
    seq.scatter_(1, lens[:, None] + torch.arange(new_tokens, device=device), torch.stack(out, 1))
    return seq, lens


def equal_length_groups(prompts: list[torch.Tensor], max_cut: float) -> list[list[torch.Tensor]]:
    """Prompts of one batch in groups of one length each (for a recurrent target, see `greedy_batch`).

    Longest first, a group takes prompts while the shortest is >= (1 - max_cut) * its longest;
    then every prompt of the group is cut from the left to the group's shortest length, so it keeps
    its end (what the continuation depends on most; the target was trained on windows that start
    anywhere). Returns the groups, lists of int64 tensors of one length; the order is not kept.
    """
    groups: list[list[torch.Tensor]] = []
    for p in sorted(prompts, key=len, reverse=True):
        if not groups or len(p) < (1 - max_cut) * len(groups[-1][0]):
            groups.append([])
        groups[-1].append(p)
    return [[p[len(p) - len(g[-1]):] for p in g] for g in groups]


def sort_function_batches(batches: list[list[torch.Tensor]]) -> list[list[torch.Tensor]]:
    """`prompt_batches`' function-prompt batches (the even ones) with their prompts re-dealt in
    order of length (batch 0 the shortest, ...), so that `equal_length_groups` makes few groups
    and cuts little. The same prompts, the same batch sizes; the window batches are unchanged."""
    even = sorted((p for b in batches[::2] for p in b), key=len)
    out, i = [], 0
    for k, b in enumerate(batches):
        if k % 2 == 0:
            b, i = even[i:i + len(b)], i + len(b)
        out.append(b)
    return out


def greedy_pool(make_target, batches: list[list[torch.Tensor]], new_tokens: int, device, sampled: float = 0.0,
                gen: torch.Generator | None = None, max_cut: float | None = None) -> dict[str, torch.Tensor]:
    """Continuations of every prompt batch, padded to one length: greedy, and sampled at T = 1
    (from `gen`) for every batch i with floor((i + 1) * sampled) > floor(i * sampled). With
    `max_cut` (a recurrent target) each batch runs as `equal_length_groups(batch, max_cut)`, whose
    prompt_len are the cut lengths.

    Returns:
        seq int64 [n, L]; prompt_len int64 [n]; valid_len int64 [n]: prompt_len + new_tokens,
        or one past the first generated <|endoftext|> (decoding stops there; later labels are void).
    """
    seqs, lens = [], []
    for i, prompts in enumerate(batches):
        sample = int((i + 1) * sampled) > int(i * sampled)
        for group in [prompts] if max_cut is None else equal_length_groups(prompts, max_cut):
            seq, plen = greedy_batch(make_target, group, new_tokens, device, gen if sample else None)
            seqs.append(seq)
            lens.append(plen)
    L = max(s.shape[1] for s in seqs)
    seq = torch.cat([torch.nn.functional.pad(s, (0, L - s.shape[1]), value=EOS_ID) for s in seqs])
    plen = torch.cat(lens)
    pos = torch.arange(L, device=device)
    is_eos = (seq == EOS_ID) & (pos[None] >= plen[:, None]) & (pos[None] < (plen + new_tokens)[:, None])
    first = torch.where(is_eos, pos[None], torch.full_like(seq, L)).min(1).values
    valid = torch.minimum(first + 1, plen + new_tokens)
    return {"seq": seq, "prompt_len": plen, "valid_len": valid}


def prompt_batches(functions: list[torch.Tensor], stream: torch.Tensor, n: int, batch: int,
                   window_lens: list[int], gen: torch.Generator) -> list[list[torch.Tensor]]:
    """n prompts in batches: even batches are function headers + docstrings (sampled with
    replacement, like the bench prompts), odd batches random windows of the train stream with a
    length cycling through window_lens (code that starts anywhere)."""
    out = []
    for b in range(n // batch):
        if b % 2 == 0:
            idx = torch.randint(0, len(functions), (batch,), generator=gen).tolist()
            out.append([functions[i] for i in idx])
        else:
            P = window_lens[(b // 2) % len(window_lens)]
            offs = torch.randint(0, stream.numel() - P, (batch,), generator=gen).tolist()
            out.append([stream[o:o + P] for o in offs])
    return out


@torch.no_grad()
def pool_taps(target: Qwen3 | Qwen35, seq: torch.Tensor, chunk: int = 256) -> torch.Tensor:
    """bf16 [n, L, n_taps * hidden]: the target's taps over each sequence (cache-free forward)."""
    out = []
    for i in range(0, seq.shape[0], chunk):
        s = seq[i:i + chunk]
        _, _, taps = target(s, torch.zeros(s.shape[0], dtype=torch.int64, device=s.device), use_cache=False)
        out.append(taps.to(torch.bfloat16))
    return torch.cat(out)


def sample_anchors(prompt_len: torch.Tensor, valid_len: torch.Tensor, count: int, gen: torch.Generator) -> torch.Tensor:
    """int64 [S, count], uniform over [prompt_len, valid_len - 2]: the first generated token (the
    first anchor at inference) through the last position that still has a label."""
    lo, hi = prompt_len, torch.maximum(valid_len - 2, prompt_len)
    u = torch.rand(prompt_len.shape[0], count, generator=gen, device=prompt_len.device)
    return lo[:, None] + (u * (hi - lo + 1)[:, None]).long().clamp(max=(hi - lo)[:, None])


def target_logits(target: Qwen3 | Qwen35, taps: torch.Tensor, anchors: torch.Tensor, B: int) -> torch.Tensor:
    """float32 [S, A, B - 1, V]: the target's logits for block positions 1..B-1 of each anchor's
    block, from the last tap (the final-norm hidden state) of the rows before them."""
    H = target.cfg.hidden_size
    rows = anchors[..., None] + torch.arange(0, B - 1, device=anchors.device)  # row p predicts p + 1
    S, A, _ = rows.shape
    rows = rows.clamp(max=taps.shape[1] - 1).reshape(S, -1)
    h = taps[..., -H:].gather(1, rows[..., None].expand(-1, -1, H))
    return target.lm_head(h.to(target.dtype)).float().view(S, A, B - 1, -1)


def run_blocks(drafter, target, pool, taps, idx, anchors, B, amp, soft_weight: float = 0.0):
    seq = pool["seq"][idx]
    v2 = drafter.cfg.dflash2 is not None  # DFlash2: + the selector's loss (drafter2_forward.py)
    with torch.autocast(seq.device.type, dtype=torch.bfloat16, enabled=amp):
        if v2:
            logits, h = block_logits2(drafter, target, taps[idx], seq, anchors, B)
        else:
            logits = block_logits(drafter, target, taps[idx], seq, anchors, B)
    soft = None
    if soft_weight > 0:
        with torch.no_grad():
            soft = target_logits(target, taps[idx], anchors, B)
    gamma = GAMMA.get(B, B / 2)
    loss, stats = block_loss(logits, seq, anchors, pool["valid_len"][idx], gamma, soft, soft_weight)
    if v2:
        walk, walk_stats = selector_loss(drafter, logits, h, seq, anchors, pool["valid_len"][idx], gamma)
        loss = loss + walk
        stats.update(walk_stats)
    return loss, stats


def main() -> None:
    ap = argparse.ArgumentParser(description="train DFlash drafters against the demo target")
    ap.add_argument("--data", default=".train-data")
    ap.add_argument("--target", required=True, help="target weights folder (train_target.py or "
                    "train_target_qwen35.py --out, or a packaged target): its config.json picks the model")
    ap.add_argument("--out", required=True, help="writes OUT/drafter-b{B}/ and OUT/drafter_log.json")
    ap.add_argument("--blocks", default="8,16")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--steps", type=int, default=6000)
    ap.add_argument("--batch", type=int, default=64, help="sequences per step")
    ap.add_argument("--anchors", type=int, default=32, help="blocks per sequence per step")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--weight-decay", type=float, default=0.01)
    ap.add_argument("--pool", type=int, default=32768, help="generated training sequences")
    ap.add_argument("--gen-batch", type=int, default=4096)
    ap.add_argument("--new-tokens", type=int, default=144, help="greedy tokens per prompt (eval: 128)")
    ap.add_argument("--sampled", type=float, default=0.0, help="fraction of the prompt batches continued by "
                    "sampling at T = 1 instead of greedily (the held-out set stays greedy)")
    ap.add_argument("--soft-weights", default="0", help="comma-separated weights w of the target-distribution "
                    "cross-entropy; one drafter per block size and weight")
    ap.add_argument("--window-lens", default="16,32,64,128,192", help="lengths of the random-window prompts")
    ap.add_argument("--max-cut", type=float, default=0.25, help="hybrid targets: the largest fraction of a prompt "
                    "cut from its left to give a generation batch one prompt length (equal_length_groups)")
    ap.add_argument("--dflash2", action="store_true", help="train DFlash2 drafters (train/common.py DEMO_DFLASH2), "
                    "written to OUT/drafter-dflash2-b{B}/")
    ap.add_argument("--eval-every", type=int, default=500)
    ap.add_argument("--time-limit", type=float, default=1e9,
                    help="seconds: the LR schedule compresses to end by then, and the loop stops")
    ap.add_argument("--resume", help="folder holding drafter-b{B}/ from an earlier run")
    args = ap.parse_args()

    t_start = time.time()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    amp = device.type == "cuda"
    torch.manual_seed(args.seed)
    if amp:
        use_sdpa()
        torch.backends.cuda.matmul.allow_tf32 = True
    blocks = [int(b) for b in args.blocks.split(",")]
    out = Path(args.out)
    log = {"args": vars(args), "device": torch.cuda.get_device_name() if amp else "cpu", "evals": []}

    # frozen target, bf16 as shipped
    dtype = torch.bfloat16 if amp else torch.float32
    make_target, tconfig, tcfg = frozen_target(Path(args.target), dtype, device)
    hybrid = isinstance(tcfg, HybridConfig)
    log["target"] = {"model_type": tconfig["model_type"], "layers": tcfg.num_hidden_layers,
                     "taps": tap_layers(tcfg.num_hidden_layers)}

    gen = torch.Generator(device=device).manual_seed(args.seed)
    cpu_gen = torch.Generator().manual_seed(args.seed)
    data = Path(args.data)
    stream = torch.from_numpy(np.fromfile(data / "train.bin", dtype=np.uint16).astype(np.int64))
    functions = load_prompt_set(data / "train_prompts.npz")
    windows = [int(p) for p in args.window_lens.split(",")]
    batches = prompt_batches(functions, stream, args.pool, args.gen_batch, windows, cpu_gen)
    max_cut = args.max_cut if hybrid else None  # a Qwen3 target's batches stay as they were
    if hybrid:
        batches = sort_function_batches(batches)
    pool = greedy_pool(make_target, batches, args.new_tokens, device, args.sampled,
                       torch.Generator(device=device).manual_seed(args.seed + 2), max_cut)
    held = greedy_pool(make_target, [load_prompt_set(data / "heldout_prompts.npz")], args.new_tokens, device,
                       max_cut=max_cut)
    log["pool"] = {"sequences": args.pool, "length": pool["seq"].shape[1], "train_function_prompts": len(functions),
                   "generated_tokens": int((pool["valid_len"] - pool["prompt_len"]).sum()),
                   "ended_by_eos": float((pool["valid_len"] < pool["prompt_len"] + args.new_tokens).float().mean()),
                   "heldout_sequences": held["seq"].shape[0], "prompt_tokens": int(pool["prompt_len"].sum()),
                   "gen_s": round(time.time() - t_start, 1)}
    target = make_target(1, pool["seq"].shape[1])  # cache-free forwards only: taps and training
    taps, held_taps = pool_taps(target, pool["seq"]), pool_taps(target, held["seq"])
    log["pool"]["taps_s"] = round(time.time() - t_start, 1)
    print(json.dumps(log["pool"]), flush=True)

    weights_soft = [float(w) for w in args.soft_weights.split(",")]
    # name -> (block size, soft weight): drafter-b{B}, or drafter-b{B}-soft{w} beside other weights
    kind = "dflash2-" if args.dflash2 else ""
    variants = {f"{kind}b{B}" + (f"-soft{w:g}" if len(weights_soft) > 1 else ""): (B, w) for B in blocks
                for w in weights_soft}
    drafters, opts, first_step = {}, {}, 0
    for name, (B, _) in variants.items():
        _, dcfg = parse_configs(B, args.dflash2, tconfig)
        d = drafter_class(dcfg)(dcfg, pool["seq"].shape[1] + B, B, dtype=torch.float32, device=device)
        init_weights(d, dcfg.num_hidden_layers)
        if args.dflash2:
            init_dflash2(d)
        if args.resume:
            folder = Path(args.resume) / f"drafter-{name}"
            d.load_state_dict({k: v.float() for k, v in load_tensors(folder).items()}, strict=False)
            first_step = int(file_metadata(folder).get("step", 0))
        opts[name] = adamw(d, args.lr, args.weight_decay, fused=amp)
        drafters[name] = d
    log["drafter_params"] = sum(p.numel() for p in next(iter(drafters.values())).parameters())

    eval_gen = torch.Generator(device=device).manual_seed(args.seed + 1)
    n_eval = held["seq"].shape[0]
    eval_anchors = sample_anchors(held["prompt_len"][:n_eval], held["valid_len"][:n_eval], 8, eval_gen)
    t_loop = time.time()

    def step(clock: int) -> dict:
        idx = torch.randint(0, args.pool, (args.batch,), generator=gen, device=device)
        stats = {}
        for name, (B, w) in variants.items():
            anchors = sample_anchors(pool["prompt_len"][idx], pool["valid_len"][idx], args.anchors, gen)
            loss, st = run_blocks(drafters[name], target, pool, taps, idx, anchors, B, amp, w)
            optimizer_step(opts[name], drafters[name], loss, lr_at(clock, args.steps, args.lr, args.warmup))
            stats[name] = (loss.detach(), st["tau"])
        return stats

    def evaluate(done: int, stats: dict) -> None:
        entry = {"step": done, "elapsed_s": round(time.time() - t_start, 1),
                 "s_per_step": round((time.time() - t_loop) / (done - first_step), 4)}
        for name, (B, _) in variants.items():
            d = drafters[name].eval()
            with torch.no_grad():
                idx_e = torch.arange(n_eval, device=device)
                hl, hs = run_blocks(d, target, held, held_taps, idx_e, eval_anchors, B, amp)
            d.train()
            if "walk_acc" in hs:
                entry.setdefault("walk", {})[name] = {"heldout_walk_acc": [round(a, 3) for a in hs["walk_acc"].tolist()],
                                                      "heldout_covered": round(float(hs["covered"]), 3)}
            entry[name] = {"train_loss": round(float(stats[name][0]), 4), "train_tau": round(float(stats[name][1]), 3),
                              "heldout_loss": round(float(hl), 4), "heldout_tau": round(float(hs["tau"]), 3),
                              "heldout_acc": [round(a, 3) for a in hs["acc"].tolist()]}
            save_sharded(param_state(d), out / f"drafter-{name}",
                         metadata={"step": done, "seed": args.seed, "heldout_tau_est": float(hs["tau"])})
        log["evals"].append(entry)
        log.update(last_step=done, wall_s=round(time.time() - t_start, 1))
        (out / "drafter_log.json").write_text(json.dumps(log, indent=1) + "\n")
        print(json.dumps(entry), flush=True)

    # the schedule compresses to end within --time-limit when that comes before --steps
    train(first_step, args.steps, args.eval_every, args.time_limit, t_start, step, evaluate, compress=True)
    print(f"done in {time.time() - t_start:.0f}s", flush=True)


if __name__ == "__main__":
    main()
