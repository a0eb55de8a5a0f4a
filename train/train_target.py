"""Train the demo Qwen3 target on the stdlib token stream (the device script of stage 1).

    python3 train/train_target.py --data .train-data --out $OUT/target --log $OUT/target_log.json --seed 0

The model is `export.qwen3.Qwen3` itself (cache-free forward, `use_cache=False`), fp32 master
weights under bf16 autocast, AdamW with warmup and cosine decay. Batches are random 512-token
windows of the train stream (files joined by <|endoftext|>). Every --eval-every steps the
held-out loss is measured on non-overlapping 512-token windows of the held-out stream; the
weights with the best held-out loss are written to --out as bf16 HF safetensors (sharded above
15 MB), with the step in the file metadata. --resume DIR restarts from such a folder at its
step (the schedule continues; Adam moments start fresh). Runs on the CPU too (smoke tests).
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from dflash_iree.export.qwen3 import Qwen3

from common import (SEQ_LEN, adamw, file_metadata, init_weights, load_tensors, lr_at, optimizer_step, param_state,
                    parse_configs, save_sharded, train, use_sdpa)


def load_stream(path: Path, device) -> torch.Tensor:
    """uint16 token file -> int64 [N] on device."""
    return torch.from_numpy(np.fromfile(path, dtype=np.uint16).astype(np.int64)).to(device)


def random_windows(data: torch.Tensor, batch: int, seq: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """x, y int64 [batch, seq]: random windows and the same shifted by one token."""
    offs = torch.randint(0, data.numel() - seq - 1, (batch,), generator=gen, device=data.device)
    idx = offs[:, None] + torch.arange(seq + 1, device=data.device)
    w = data[idx]
    return w[:, :-1], w[:, 1:]


def lm_loss(model: Qwen3, x: torch.Tensor, y: torch.Tensor, amp: bool) -> torch.Tensor:
    """Mean next-token cross-entropy (float32) of x [B, T] against y [B, T]."""
    start = torch.zeros(x.shape[0], dtype=torch.int64, device=x.device)
    with torch.autocast(x.device.type, dtype=torch.bfloat16, enabled=amp):
        _, logits, _ = model(x, start, use_cache=False)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


@torch.no_grad()
def heldout_loss(model: Qwen3, data: torch.Tensor, seq: int, batch: int, amp: bool, limit: int | None = None) -> float:
    """Token-weighted mean loss over non-overlapping seq-token windows of the held-out stream
    (the first `limit` windows when given: smoke tests)."""
    n = (data.numel() - 1) // seq
    n = min(n, limit) if limit else n
    idx = torch.arange(n, device=data.device)[:, None] * seq + torch.arange(seq + 1, device=data.device)
    total, count = 0.0, 0
    for i in range(0, n, batch):
        w = data[idx[i:i + batch]]
        total += float(lm_loss(model, w[:, :-1], w[:, 1:], amp)) * w[:, 1:].numel()
        count += w[:, 1:].numel()
    return total / count


def qwen3_model(device) -> tuple[torch.nn.Module, int]:
    """The demo Qwen3 target, initialised: (module, num_hidden_layers)."""
    tcfg, _ = parse_configs()
    model = Qwen3(tcfg, SEQ_LEN, (), dtype=torch.float32, device=device)
    init_weights(model, tcfg.num_hidden_layers)
    return model, tcfg.num_hidden_layers


def main(build=qwen3_model, description: str = "train the demo Qwen3 target") -> None:
    """The stage-1 loop; `build(device)` gives the initialised model (train_target_qwen35.py passes its own)."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--data", default=".train-data")
    ap.add_argument("--out", required=True, help="folder for the best weights (bf16 safetensors)")
    ap.add_argument("--log", help="JSON log path (default: OUT/../target_log.json)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--steps", type=int, default=3000)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--lr", type=float, default=1.5e-3)
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--eval-every", type=int, default=100)
    ap.add_argument("--heldout-windows", type=int, help="evaluate only this many windows (smoke tests)")
    ap.add_argument("--time-limit", type=float, default=1e9, help="stop the loop after this many seconds")
    ap.add_argument("--resume", help="weights folder written by this script")
    args = ap.parse_args()

    t_start = time.time()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    amp = device.type == "cuda"
    torch.manual_seed(args.seed)
    if device.type == "cuda":
        use_sdpa(causal_hint=True)
        torch.backends.cuda.matmul.allow_tf32 = True
    model, _ = build(device)
    first_step = 0
    if args.resume:
        state = load_tensors(Path(args.resume))
        model.load_state_dict({k: v.float() for k, v in state.items()}, strict=False)
        first_step = int(file_metadata(Path(args.resume)).get("step", 0))
    n_params = sum(p.numel() for p in model.parameters())

    opt = adamw(model, args.lr, args.weight_decay, fused=device.type == "cuda")
    train_stream = load_stream(Path(args.data) / "train.bin", device)
    held = load_stream(Path(args.data) / "heldout.bin", device)
    gen = torch.Generator(device=device).manual_seed(args.seed * 1000 + first_step)

    out = Path(args.out)
    log_path = Path(args.log) if args.log else out.parent / "target_log.json"
    log = {"args": vars(args), "params": n_params, "train_tokens": train_stream.numel(), "heldout_tokens": held.numel(),
           "device": torch.cuda.get_device_name() if amp else "cpu", "evals": [], "first_step": first_step}
    best = [float("inf"), -1]
    t_loop = time.time()

    def step(clock: int) -> torch.Tensor:
        x, y = random_windows(train_stream, args.batch, SEQ_LEN, gen)
        loss = lm_loss(model, x, y, amp)
        optimizer_step(opt, model, loss, lr_at(clock, args.steps, args.lr, args.warmup))
        return loss

    def evaluate(done: int, loss: torch.Tensor) -> None:
        model.eval()
        h = heldout_loss(model, held, SEQ_LEN, args.batch, amp, args.heldout_windows)
        model.train()
        tok_s = (done - first_step) * args.batch * SEQ_LEN / (time.time() - t_loop)
        entry = {"step": done, "train_loss": round(float(loss.detach()), 4), "heldout_loss": round(h, 4),
                 "epochs": round(done * args.batch * SEQ_LEN / train_stream.numel(), 2),
                 "tok_per_s": int(tok_s), "elapsed_s": round(time.time() - t_start, 1)}
        log["evals"].append(entry)
        print(json.dumps(entry), flush=True)
        if h < best[0]:
            best[:] = [h, done]
            save_sharded(param_state(model), out, metadata={"step": done, "heldout_loss": h, "seed": args.seed})
        log.update(best_heldout_loss=best[0], best_step=best[1], last_step=done, wall_s=round(time.time() - t_start, 1))
        log_path.write_text(json.dumps(log, indent=1) + "\n")

    train(first_step, args.steps, args.eval_every, args.time_limit, t_start, step, evaluate)
    print(f"best held-out loss {best[0]:.4f} (ppl {math.exp(best[0]):.2f}) at step {best[1]}; "
          f"{time.time() - t_start:.0f}s", flush=True)


if __name__ == "__main__":
    main()
