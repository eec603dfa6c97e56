#!/usr/bin/env python
"""Train a small character-level GPT with shardamp's ZeRO-2 DistributedFusedAdam.

The loop is loop B of docs/amp-loops.md, the standard PyTorch AMP recipe, which works unchanged with a
sharded optimizer:

    scaler.scale(loss).backward()   # grads are reduce-scattered into shards during backward
    scaler.unscale_(opt)            # ShardedGradScaler: records 1/scale, agrees found-inf globally
    norm = opt.clip_grad_norm(max)  # global unscaled pre-clip norm; the clip happens in the step kernel
    scaler.step(opt); scaler.update()

At the end rank 0 prints the optimizer memory per rank against torch.optim.AdamW (measured), and
retrains the first --parity-steps steps unsharded with torch.optim.AdamW +
torch.nn.utils.clip_grad_norm_ + torch.amp.GradScaler on the union of all ranks' batches: in fp32
the parameters must agree within rtol 1e-5 / atol 1e-6, or the exit code is 1.

    python examples/train.py                                   # 2 CPU ranks (gloo), a few minutes
    python examples/train.py --world-size 4 --steps 100
    torchrun --nproc-per-node 8 examples/train.py --device cuda --precision bf16
    python examples/train.py --device cuda --precision fp16    # one rank per visible GPU

The first run builds shardamp's fused kernels just in time (about a minute on a CPU); later runs
load them from torch's extension cache.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Dict, List, Optional

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from chardata import CharData
from gpt import GPT, GPTConfig, loss_fn
from recipe import Recipe
from reporting import Progress, memory_lines, optimizer_bytes, save_outputs
from shardamp.optim import DistributedFusedAdam
from shardamp.scaler import ShardedGradScaler
from torch_reference import Trajectory, compare, train_reference


# ------------------------------------------------------------------ command line
def _int_at_least(lo: int):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < lo:
            raise argparse.ArgumentTypeError(f"must be >= {lo}, got {value}")
        return value

    return parse


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not (value > 0 and value != float("inf")):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text}")
    return value


def _fraction(text: str) -> float:
    value = float(text)
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"must be in [0, 1], got {text}")
    return value


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Show defaults, except for flags whose default is resolved later (None)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        return action.help if action.default is None else super()._get_help_string(action)


def _under_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="Without torchrun the script spawns its own ranks (gloo on CPU, NCCL on CUDA) with a file:// "
        "rendezvous in a temp dir. Under torchrun (or any launcher setting RANK/WORLD_SIZE) it joins that "
        "group instead; with --device cuda each rank uses GPU LOCAL_RANK. Exit code 1 if the fp32 parity "
        "check fails or the ranks end with different parameters, 2 for bad flags.",
        formatter_class=_HelpFormatter,
    )
    run = p.add_argument_group("run")
    run.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="where each rank trains")
    run.add_argument("--world-size", type=_int_at_least(1), default=None,
                     help="ranks to spawn when not under torchrun (default: 2 on cpu, all visible GPUs on cuda)")
    run.add_argument("--precision", choices=["fp32", "bf16", "fp16"], default=None,
                     help="fp32: no autocast, ShardedGradScaler still on (exact: the scale is a power of two); "
                     "bf16: bf16 autocast, no loss scaling; fp16: fp16 autocast + ShardedGradScaler (cuda only). "
                     "Default: fp32 on cpu, bf16 on cuda. Params, master weights and Adam state stay fp32 unless --param-dtype / --exp-avg-dtype / --exp-avg-sq-dtype say otherwise")
    run.add_argument("--steps", type=_int_at_least(1), default=200, help="optimizer steps")
    run.add_argument("--seed", type=int, default=0, help="model init and batch sampling")
    run.add_argument("--out", default="./out", help="directory for metrics.json and loss.png")
    run.add_argument("--log-every", type=_int_at_least(1), default=10, help="steps between progress updates")
    run.add_argument("--sample-chars", type=_int_at_least(0), default=160, help="characters to sample at the end")
    model = p.add_argument_group("model and data")
    model.add_argument("--model-dim", type=_int_at_least(8), default=128, help="transformer width")
    model.add_argument("--layers", type=_int_at_least(1), default=4, help="transformer blocks")
    model.add_argument("--heads", type=_int_at_least(1), default=4, help="attention heads (must divide --model-dim)")
    model.add_argument("--seq-len", type=_int_at_least(2), default=64, help="context length in characters")
    model.add_argument("--batch-size", type=_int_at_least(1), default=16, help="sequences per rank per step")
    optim = p.add_argument_group("optimizer")
    optim.add_argument("--lr", type=_positive_float, default=3e-3, help="peak learning rate")
    optim.add_argument("--warmup-steps", type=_int_at_least(0), default=20, help="linear warmup steps")
    optim.add_argument("--min-lr-ratio", type=_fraction, default=0.1, help="cosine decay floor, as a fraction of --lr")
    optim.add_argument("--weight-decay", type=float, default=0.1, help="AdamW decay for matrices and embeddings")
    optim.add_argument("--max-grad-norm", type=_positive_float, default=1.0, help="global grad-norm clip")
    optim.add_argument("--bucket-cap-mb", type=_positive_float, default=1.0,
                       help="reduce-scatter bucket size; small buckets overlap communication with backward")
    optim.add_argument("--overlap-param-sync", action="store_true",
                       help="leave the param all-gather in flight after step(), waited for in the next forward")
    optim.add_argument("--exp-avg-dtype", choices=["fp32", "bf16"], default="fp32",
                       help="storage dtype of Adam's first moment (bf16: 2 B/param instead of 4, rounded to nearest even)")
    optim.add_argument("--exp-avg-sq-dtype", choices=["fp32", "bf16"], default="fp32",
                       help="storage dtype of Adam's second moment")
    optim.add_argument("--param-dtype", choices=["fp32", "bf16"], default="fp32",
                       help="model param dtype (bf16: the optimizer keeps an fp32 master and all-gathers bf16)")
    optim.add_argument("--store-param-remainders", action="store_true",
                       help="with --param-dtype bf16: keep only the low 16 bits of each fp32 master next to "
                       "the bf16 param (2 B/param instead of 4, bitwise the same updates)")
    optim.add_argument("--init-scale", type=_positive_float, default=2.0**16, help="initial loss scale")
    optim.add_argument("--growth-interval", type=_int_at_least(1), default=100,
                       help="clean steps before the loss scale doubles")
    check = p.add_argument_group("checks")
    check.add_argument("--parity-steps", type=_int_at_least(0), default=20,
                       help="steps (capped at --steps) retrained unsharded with torch.optim.AdamW for the parity "
                       "check; 0 skips the check (one AdamW step still runs to measure its memory)")
    args = p.parse_args(argv)

    if args.weight_decay < 0:
        p.error(f"argument --weight-decay: must be >= 0, got {args.weight_decay}")
    if args.model_dim % args.heads:
        p.error(f"--model-dim {args.model_dim} must be divisible by --heads {args.heads}")
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: CUDA is not available here (torch.cuda.is_available() is False); use --device cpu")
    if args.precision is None:
        args.precision = "bf16" if args.device == "cuda" else "fp32"
    if args.precision == "fp16" and args.device == "cpu":
        p.error("--precision fp16 needs --device cuda (fp16 autocast + loss scaling is a GPU recipe); "
                "on CPU use fp32 (default) or bf16")
    if _under_torchrun():
        env_world = int(os.environ["WORLD_SIZE"])
        if args.world_size not in (None, env_world):
            p.error(f"--world-size {args.world_size}: under torchrun the world size is {env_world} "
                    "(set it with torchrun --nproc-per-node)")
        args.world_size = env_world
    elif args.world_size is None:
        args.world_size = torch.cuda.device_count() if args.device == "cuda" else 2
    if args.device == "cuda" and not _under_torchrun() and args.world_size > torch.cuda.device_count():
        p.error(f"--world-size {args.world_size} > {torch.cuda.device_count()} visible GPUs (one GPU per rank)")
    if args.store_param_remainders and args.param_dtype != "bf16":
        p.error("--store-param-remainders needs --param-dtype bf16 (the master's high halves are the bf16 params)")
    args.parity_steps = min(args.parity_steps, args.steps)
    return args


_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def lossy_storage(args: argparse.Namespace) -> List[str]:
    """The options that make the run differ from fp32 torch.optim.AdamW beyond round-off."""
    out = [f"{k} bf16" for k in ("exp_avg", "exp_avg_sq") if getattr(args, f"{k}_dtype") == "bf16"]
    if args.param_dtype == "bf16":
        out.append("bf16 params" + (" + remainders" if args.store_param_remainders else ""))
    return out


def make_recipe(args: argparse.Namespace) -> Recipe:
    return Recipe(
        steps=args.steps, batch_size=args.batch_size, lr=args.lr, min_lr_ratio=args.min_lr_ratio,
        warmup_steps=args.warmup_steps, weight_decay=args.weight_decay, max_grad_norm=args.max_grad_norm,
        precision=args.precision, init_scale=args.init_scale, growth_interval=args.growth_interval,
    )


# ------------------------------------------------------------------ training (every rank)
@dataclass
class Result:
    model: GPT
    data: CharData
    ours: Trajectory  # the parity prefix, for the comparison
    init_state: Optional[Dict[str, torch.Tensor]]  # rank 0: the weights every rank started from
    losses: List[float]  # mean over ranks, every step
    memory: List[int]  # optimizer bytes per rank, after the last step
    memory_peak: List[int]  # ... right after the last backward
    memory_stats: List[Dict[str, int]]  # opt.memory_stats() per rank, after the last step
    ranks_agree: bool
    skipped: int
    ms_per_step: float


def train(args: argparse.Namespace, rank: int, world: int, device: torch.device) -> Result:
    recipe = make_recipe(args)
    torch.manual_seed(args.seed)
    data = CharData(args.seq_len, args.seed)
    cfg = GPTConfig(data.vocab_size, args.seq_len, args.model_dim, args.layers, args.heads)
    # The model must be on its final device and dtype before the optimizer is built: the optimizer
    # turns its params into views of flat bucket buffers (and broadcasts rank 0's weights).
    model = GPT(cfg).to(device=device, dtype=_DTYPES[args.param_dtype])
    opt = DistributedFusedAdam(
        model.param_groups(recipe.weight_decay), lr=recipe.lr, betas=recipe.betas, eps=recipe.eps,
        bucket_cap_mb=args.bucket_cap_mb, overlap_param_sync=args.overlap_param_sync,
        exp_avg_dtype=_DTYPES[args.exp_avg_dtype], exp_avg_sq_dtype=_DTYPES[args.exp_avg_sq_dtype],
        store_param_remainders=args.store_param_remainders,
    )
    if args.overlap_param_sync:
        opt.attach(model)  # every param read in the forward waits for its in-flight all-gather
    scaler = ShardedGradScaler(device.type, **recipe.scaler_kwargs())
    n_params = sum(p.numel() for p in model.parameters())
    init_state = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()} if rank == 0 else None
    if rank == 0:
        scaling = "ShardedGradScaler" if recipe.scaler_enabled else "no loss scaling"
        print(f"GPT {args.layers}x{args.model_dim} ({n_params / 1e6:.2f}M params, vocab {data.vocab_size}, "
              f"seq {args.seq_len}), world {world} on {device.type} ({dist.get_backend()}), {args.precision} + "
              f"{scaling}, batch {args.batch_size}/rank, {args.steps} steps")
        print(opt, flush=True)

    ours = Trajectory()
    losses: List[torch.Tensor] = []
    skipped = torch.zeros((), dtype=torch.int64, device=device)
    progress = Progress(args.steps, rank == 0, args.log_every)
    last = args.steps - 1
    memory = memory_peak = 0
    stats: Dict[str, int] = {}
    t_start = t_log = time.perf_counter()
    for step in range(args.steps):
        for group in opt.param_groups:  # edits between steps take effect, as in torch
            group["lr"] = recipe.lr_at(step)
        x, y = (t.to(device, non_blocking=True) for t in data.batch(step, rank, args.batch_size))
        with recipe.autocast(device):
            loss = loss_fn(model(x), y)
        scaler.scale(loss).backward()  # buckets are reduce-scattered while backward runs
        if step == last:  # in-flight bucket buffers are still alive here
            memory_peak = optimizer_bytes(opt, model)
        scaler.unscale_(opt)  # no pass over the grads: 1/scale is folded into the step kernel
        norm = opt.clip_grad_norm(recipe.max_grad_norm)  # global, unscaled, pre-clip (device tensor)
        scaler.step(opt)  # skipped on the device if any rank found inf/NaN
        scaler.update()
        if step == last:
            memory = optimizer_bytes(opt, model)
            stats = opt.memory_stats()
        opt.zero_grad(set_to_none=True)

        losses.append(loss.detach())
        if scaler.is_enabled():
            skipped += scaler.last_step_skipped
        if step < args.parity_steps:  # host syncs, but only over the short parity prefix
            ours.norms.append(norm.item())
            ours.scales.append(scaler.get_scale())
            if step == args.parity_steps - 1 and rank == 0:
                opt.param_sync()  # params are read outside a forward
                ours.params = {n: p.detach().float().cpu().clone() for n, p in model.named_parameters()}
        done = step + 1
        if done % args.log_every == 0 or done == args.steps:
            n = (done - 1) % args.log_every + 1
            window = torch.stack(losses[-n:]).float().mean()
            dist.all_reduce(window)  # every rank logs at the same steps, so this lines up
            now = time.perf_counter()
            progress.update(done, n, {
                "loss": f"{window.item() / world:.3f}",
                "gnorm": f"{norm.item():.3f}",
                "scale": f"{scaler.get_scale():g}",
                "ms/step": f"{1e3 * (now - t_log) / n:.0f}",
            })
            t_log = now
    progress.close()
    ms_per_step = 1e3 * (time.perf_counter() - t_start) / args.steps

    opt.param_sync()
    curve = torch.stack(losses).float()
    dist.all_reduce(curve)
    # ZeRO all-gathers the full params after each step: every rank must hold identical weights
    flat = torch.cat([p.detach().reshape(-1).float() for p in model.parameters()])
    hi, lo = flat.clone(), flat.clone()
    dist.all_reduce(hi, op=dist.ReduceOp.MAX)
    dist.all_reduce(lo, op=dist.ReduceOp.MIN)
    mems: List[Optional[List[int]]] = [None] * world
    dist.all_gather_object(mems, [memory, memory_peak, stats])
    return Result(
        model=model, data=data, ours=ours, init_state=init_state,
        losses=(curve / world).tolist(), memory=[m[0] for m in mems], memory_peak=[m[1] for m in mems],
        memory_stats=[m[2] for m in mems],
        ranks_agree=torch.equal(hi, lo), skipped=int(skipped.item()), ms_per_step=ms_per_step,
    )


# ------------------------------------------------------------------ the end (rank 0)
@torch.no_grad()
def evaluate(model: GPT, data: CharData, recipe: Recipe, device: torch.device, batch_size: int) -> float:
    total = 0.0
    batches = data.val_batches(8, batch_size)
    for x, y in batches:
        with recipe.autocast(device):
            total += loss_fn(model(x.to(device)), y.to(device)).item()
    return total / len(batches)


def report(args: argparse.Namespace, res: Result, world: int, device: torch.device) -> int:
    recipe = make_recipe(args)
    val_loss = evaluate(res.model, res.data, recipe, device, args.batch_size)
    print(f"final train loss {res.losses[-1]:.4f} (step 1: {res.losses[0]:.4f}), val loss {val_loss:.4f}, "
          f"{res.ms_per_step:.0f} ms/step, skipped steps {res.skipped}")
    if args.sample_chars:
        prompt = "the "
        g = torch.Generator().manual_seed(args.seed)
        with recipe.autocast(device):
            ids = res.model.generate(res.data.encode(prompt)[None].to(device), args.sample_chars, g)
        print("sample: " + repr(res.data.decode(ids[0].cpu())))

    ref = train_reference(
        lambda: GPT(res.model.cfg), res.init_state, res.data, recipe, world, args.parity_steps, device
    )
    n_params = sum(p.numel() for p in res.model.parameters())
    for line in memory_lines(res.memory, res.memory_peak, ref.optimizer_bytes, n_params, args.bucket_cap_mb):
        print(line)
    for r, st in enumerate(res.memory_stats):
        print(f"  rank {r} memory_stats (B per model param): " + ", ".join(
            f"{k} {v / n_params:.2f}" for k, v in st.items()))
    passed = True
    lossy = lossy_storage(args)
    if args.parity_steps:  # with bf16 storage the comparison is informational (not round-off)
        passed, lines = compare(res.ours, ref, args.precision if not lossy else f"{args.precision}, {', '.join(lossy)}")
        print("\n".join(lines))
    else:
        print("parity vs torch.optim.AdamW: skipped (--parity-steps 0)")
    print(f"ranks hold identical parameters: {'yes' if res.ranks_agree else 'NO'}")
    metrics = {
        "loss": res.losses, "val_loss": val_loss, "ref_loss": ref.losses, "args": vars(args),
        "memory_bytes_per_rank": res.memory, "torch_adamw_memory_bytes": ref.optimizer_bytes,
        "n_params": n_params, "parity_passed": passed, "skipped_steps": res.skipped,
        "memory_stats_per_rank": res.memory_stats, "final_loss": res.losses[-1],
    }
    save_outputs(args.out, metrics, f"char-GPT {args.layers}x{args.model_dim}, world {world}, "
                 f"{args.precision}, DistributedFusedAdam + ShardedGradScaler")
    return 0 if passed and res.ranks_agree else 1


# ------------------------------------------------------------------ launching
def run_rank(rank: int, world: int, init_method: str, args: argparse.Namespace) -> int:
    """One rank: join the group, train, and (rank 0) report. Returns the exit code."""
    if args.device == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world)
    try:
        result = train(args, rank, world, device)
    finally:
        dist.destroy_process_group()
    # the reference needs no collectives: the other ranks are done
    return report(args, result, world, device) if rank == 0 else 0


def _spawned(rank: int, world: int, init_method: str, args: argparse.Namespace) -> None:
    # share the cores between the ranks instead of each rank using all of them
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    code = run_rank(rank, world, init_method, args)
    if code:
        sys.exit(code)


def main(argv: Optional[List[str]] = None) -> int:
    args = parse_args(argv)
    t0 = time.perf_counter()
    if _under_torchrun():
        code = run_rank(int(os.environ["RANK"]), args.world_size, "env://", args)
    else:
        with tempfile.TemporaryDirectory(prefix="shardamp-example-") as tmp:
            init_method = f"file://{os.path.join(tmp, 'rendezvous')}"  # no ports, no races
            try:
                mp.start_processes(_spawned, args=(args.world_size, init_method, args),
                                   nprocs=args.world_size, start_method="spawn")
                code = 0
            except mp.ProcessExitedException as exc:  # a rank exited non-zero (e.g. parity FAIL)
                print(f"error: rank {exc.error_index} exited with code {exc.exit_code}", file=sys.stderr)
                code = exc.exit_code or 1
            except mp.ProcessRaisedException as exc:  # carries the rank's traceback
                print(f"error: {exc}", file=sys.stderr)
                code = 1
    if not _under_torchrun() or int(os.environ["RANK"]) == 0:
        print(f"total time {time.perf_counter() - t0:.1f}s, exit code {code}")
    return code


if __name__ == "__main__":
    sys.exit(main())
