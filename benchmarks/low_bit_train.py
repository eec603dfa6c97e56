#!/usr/bin/env python
"""Low-bit moments in training: final loss, peak memory and step time of one model trained with
each moment format, beside torch's fused AdamW and the peers' 8-bit optimizers, in one process.

Every run trains the same GPT-2 (transformers' ``GPT2LMHeadModel``, built locally: no download) on
the examples' generated character data (``examples/chardata.py``) from the same initial weights,
with the same batches, schedule (linear warmup, cosine decay), weight decay, clipping at 1.0 and
bf16 autocast; only the optimizer differs. World 1, no process group: what is compared is the
moments' storage, not the sharding.

    python benchmarks/low_bit_train.py --device cuda --model 124m --steps 2000 --out out/low_bit
    python benchmarks/low_bit_train.py --device cuda --memory --model 124m,1.3b --out out/low_bit
    python benchmarks/low_bit_train.py --device cpu --model tiny --steps 30      # a smoke run

Runs (``--runs``, comma separated; a peer that does not import is skipped with its reason):

- ``torch``: ``torch.optim.AdamW(fused=True)`` (CUDA; ``foreach`` on the CPU), fp32 params.
- ``fp32`` / ``bf16`` / ``8bit`` / ``4bit``: ``DistributedFusedAdam`` with both moments in that
  format, fp32 params (the master is the param itself).
- ``8bit-rem``: bf16 params with fp32-exact remainders (``store_param_remainders=True``) and
  8-bit moments: the lightest state (memory runs).
- ``torchao8bit`` / ``torchao4bit``: torchao's ``AdamW8bit`` / ``AdamW4bit``, fp32 params.
- ``bnb8bit``: bitsandbytes' ``AdamW8bit``, fp32 params.

``--memory`` runs a few steps per run and reports ``torch.cuda.max_memory_allocated`` (model,
grads, optimizer state and the activations of the batch) instead of training to the end.
"""
from __future__ import annotations

import argparse
import gc
import json
import math
import sys
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple

import torch

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT / "examples"))
try:
    import shardamp  # noqa: F401
except ImportError:  # the source tree's package where it is not installed
    sys.path.insert(0, str(ROOT))

from chardata import CharData  # noqa: E402

# name -> (n_embd, n_layer, n_head, vocab); vocab 50257 keeps GPT-2's parameter count (the char
# data uses its first ids only; every row of the tied embedding still gets grads through the softmax)
MODELS = {
    "tiny": (64, 2, 2, 512),
    "124m": (768, 12, 12, 50257),
    "350m": (1024, 24, 16, 50257),
    "1.3b": (2048, 24, 16, 50257),
}
RUNS = ("torch", "fp32", "bf16", "8bit", "4bit", "8bit-rem", "torchao8bit", "torchao4bit", "bnb8bit")
LR, MIN_LR_RATIO, WARMUP, BETAS, EPS, WEIGHT_DECAY, MAX_NORM = 6e-4, 0.1, 100, (0.9, 0.95), 1e-8, 0.1, 1.0


def build_model(name: str, seq: int, device: torch.device, bf16: bool) -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    width, layers, heads, vocab = MODELS[name]
    cfg = GPT2Config(vocab_size=vocab, n_positions=max(1024, seq), n_embd=width, n_layer=layers, n_head=heads,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False)
    torch.manual_seed(0)
    with torch.device(device):
        model = GPT2LMHeadModel(cfg)
    if bf16:
        model = model.to(torch.bfloat16)
    return model.train()


def param_groups(model: torch.nn.Module) -> List[dict]:
    """Weight decay on the matrices only (GPT-2's recipe)."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    return [dict(params=decay, weight_decay=WEIGHT_DECAY), dict(params=rest, weight_decay=0.0)]


def make_optimizer(run: str, model: torch.nn.Module, device: torch.device) -> Tuple[object, bool]:
    """The run's optimizer and whether it clips inside its step (else the loop calls torch's clip)."""
    groups = param_groups(model)
    if run == "torch":
        kind = dict(fused=True) if device.type == "cuda" else dict(foreach=True)
        return torch.optim.AdamW(groups, lr=LR, betas=BETAS, eps=EPS, **kind), False
    if run in ("fp32", "bf16", "8bit", "4bit", "8bit-rem"):
        from shardamp.optim import DistributedFusedAdam

        fmt = {"fp32": torch.float32, "bf16": torch.bfloat16, "8bit": "8bit", "4bit": "4bit",
               "8bit-rem": "8bit"}[run]
        return DistributedFusedAdam(groups, lr=LR, betas=BETAS, eps=EPS, exp_avg_dtype=fmt, exp_avg_sq_dtype=fmt,
                                    store_param_remainders=run == "8bit-rem", max_grad_norm=MAX_NORM), True
    if run in ("torchao8bit", "torchao4bit"):
        from torchao.optim import AdamW4bit, AdamW8bit

        cls = AdamW8bit if run == "torchao8bit" else AdamW4bit
        return cls(groups, lr=LR, betas=BETAS, eps=EPS), False
    if run == "bnb8bit":
        import bitsandbytes as bnb

        return bnb.optim.AdamW8bit(groups, lr=LR, betas=BETAS, eps=EPS), False
    raise ValueError(f"--runs: unknown run {run!r}; expected some of {', '.join(RUNS)}")


def lr_at(step: int, steps: int) -> float:
    if step < WARMUP:
        return LR * (step + 1) / WARMUP
    progress = min(1.0, (step - WARMUP) / max(1, steps - WARMUP))
    return LR * (MIN_LR_RATIO + (1 - MIN_LR_RATIO) * 0.5 * (1 + math.cos(math.pi * progress)))


def loss_of(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, device: torch.device) -> torch.Tensor:
    with torch.autocast(device.type, dtype=torch.bfloat16):
        logits = model(input_ids=x).logits
    return torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), y.flatten())


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def train(run: str, args, data: CharData, device: torch.device, steps: int) -> Dict[str, object]:
    bf16 = run == "8bit-rem"
    model = build_model(args.model_name, args.seq, device, bf16)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    opt, clips_inside = make_optimizer(run, model, device)
    params = [p for p in model.parameters()]
    losses: List[float] = []
    times: List[float] = []
    for step in range(steps):
        x, y = (t.to(device) for t in data.batch(step, 0, args.batch))
        for g in opt.param_groups:
            if isinstance(g["lr"], torch.Tensor):  # torchao keeps lr as a tensor and refuses a float
                g["lr"].fill_(lr_at(step, steps))
            else:
                g["lr"] = lr_at(step, steps)
        sync(device)
        t0 = time.perf_counter()
        loss = loss_of(model, x, y, device)
        loss.backward()
        if not clips_inside:
            torch.nn.utils.clip_grad_norm_(params, MAX_NORM)
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync(device)
        times.append(time.perf_counter() - t0)
        if step % args.log_every == 0 or step == steps - 1:
            losses.append(loss.item())
            print(f"  {run:12s} step {step:5d} loss {losses[-1]:.4f}", flush=True)
    peak = torch.cuda.max_memory_allocated() if device.type == "cuda" else None
    model.eval()
    with torch.no_grad():
        val = [loss_of(model, x.to(device), y.to(device), device).item()
               for x, y in data.val_batches(args.val_batches, args.batch)]
    warm = times[min(10, len(times) - 1):]
    row = dict(run=run, steps=steps, final_train_loss=sum(losses[-3:]) / len(losses[-3:]),
               val_loss=sum(val) / len(val), ms_per_step=1e3 * sorted(warm)[len(warm) // 2],
               peak_bytes=peak, params=sum(p.numel() for p in params))
    del opt, model, params
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return row


def peer_missing(run: str) -> Optional[str]:
    """Why a peer's run cannot happen here, or None."""
    module = {"torchao8bit": "torchao.optim", "torchao4bit": "torchao.optim", "bnb8bit": "bitsandbytes"}.get(run)
    if module is None:
        return None
    try:
        __import__(module)
    except Exception as exc:  # any import failure of an optional peer: the run is skipped, its reason kept
        return f"{module} does not import: {type(exc).__name__}: {exc}"
    return None


def table(rows: List[dict], memory: bool) -> str:
    if memory:
        lines = ["| model | run | params | peak allocated | B per param |", "|---|---|---|---|---|"]
        for r in rows:
            if "skipped" in r:
                lines.append(f"| {r['model']} | {r['run']} | - | skipped: {r['skipped']} | - |")
                continue
            peak = r["peak_bytes"]
            lines.append(f"| {r['model']} | {r['run']} | {r['params'] / 1e6:.1f}M | "
                         f"{peak / 2**30:.2f} GiB | {peak / r['params']:.2f} |")
        return "\n".join(lines)
    lines = ["| run | final train loss | val loss | ms / step | peak allocated |", "|---|---|---|---|---|"]
    for r in rows:
        if "skipped" in r:
            lines.append(f"| {r['run']} | skipped: {r['skipped']} | | | |")
            continue
        peak = "-" if r["peak_bytes"] is None else f"{r['peak_bytes'] / 2**30:.2f} GiB"
        lines.append(f"| {r['run']} | {r['final_train_loss']:.4f} | {r['val_loss']:.4f} | "
                     f"{r['ms_per_step']:.1f} | {peak} |")
    return "\n".join(lines)


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--model", default="124m", help=f"comma separated, of {', '.join(MODELS)}")
    ap.add_argument("--runs", default="torch,fp32,8bit,4bit,torchao8bit,bnb8bit")
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--val-batches", type=int, default=8)
    ap.add_argument("--log-every", type=int, default=200)
    ap.add_argument("--memory", action="store_true", help="peak memory over --memory-steps steps per run")
    ap.add_argument("--memory-steps", type=int, default=3)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    runs = [r for r in args.runs.split(",") if r]
    for r in runs:
        if r not in RUNS:
            ap.error(f"--runs: unknown run {r!r}; expected some of {', '.join(RUNS)}")
    data = CharData(args.seq, seed=0)
    rows = []
    for model_name in args.model.split(","):
        if model_name not in MODELS:
            ap.error(f"--model: unknown model {model_name!r}; expected some of {', '.join(MODELS)}")
        args.model_name = model_name
        for run in runs:
            why = peer_missing(run)
            if why is not None:
                print(f"{run}: skipped ({why})", flush=True)
                rows.append(dict(model=model_name, run=run, skipped=why))
                continue
            row = train(run, args, data, device, args.memory_steps if args.memory else args.steps)
            row["model"] = model_name
            rows.append(row)
            print(json.dumps(row), flush=True)
            write(args, rows, device)  # after every run: a run cut off by a time limit keeps the ones before it
    print(write(args, rows, device))
    return 0


def write(args, rows: List[dict], device: torch.device) -> str:
    """The table so far (printed by the caller) and, with --out, its JSON and markdown files."""
    meta = dict(device=torch.cuda.get_device_name() if device.type == "cuda" else "cpu", torch=torch.__version__,
                command=" ".join(sys.argv), batch=args.batch, seq=args.seq)
    text = table(rows, args.memory)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        stem = "memory" if args.memory else "accuracy"
        (args.out / f"low_bit_{stem}.json").write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
        (args.out / f"low_bit_{stem}.md").write_text(json.dumps(meta) + "\n\n" + text + "\n")
    return json.dumps(meta) + "\n" + text


if __name__ == "__main__":
    sys.exit(main())
