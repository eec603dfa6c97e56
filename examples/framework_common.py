"""Shared by examples/{lightning,accelerate,transformers}_train.py: flags, the model and its data,
the parity check against unsharded torch.optim.AdamW, and step timing.

Each script trains the same MLP regression twice under its framework: once with the shardamp
integration (one changed line) and once with the framework's own default (DDP + torch AdamW,
fused on CUDA), then prints:

* ``parity vs torch.optim.AdamW (...)``: the shardamp run's final params against AdamW +
  ``clip_grad_norm_`` (+ ``torch.amp.GradScaler`` for fp16) on one process, fed at every step the
  union of the micro-batches all ranks saw (recorded by sample index, so nothing syncs while
  timing), each micro-batch in the same autocast dtype;
* ``step time``: mean wall time per optimizer step after warm-up, shardamp vs the default.
"""
from __future__ import annotations

import argparse
import math
import os
import shutil
import subprocess
import sys
import time
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

LR, BETAS, EPS, WD = 1e-3, (0.9, 0.95), 1e-8, 0.1
TOLERANCE = {"fp32": (1e-4, 1e-6), "bf16": (1e-3, 1e-4), "fp16": (1e-3, 1e-4)}  # params: rtol, atol
# norms, relative: fp16 grads of a loss divided by the micro-batch count here and by the rank count
# after the reduction there underflow slightly differently (powers of two, but fp16 subnormals)
NORM_RTOL = {"fp32": 1e-4, "bf16": 1e-4, "fp16": 2e-3}


def parse_args(description: str) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--precision", choices=["fp32", "bf16", "fp16"], default=None,
                   help="autocast dtype (default: fp32 on cpu, bf16 on cuda); fp16 uses a grad scaler")
    p.add_argument("--world-size", type=int, default=None,
                   help="ranks to launch (default: 2 on cpu, the visible GPUs on cuda)")
    p.add_argument("--steps", type=int, default=None, help="optimizer steps (default: 8 cpu, 40 cuda)")
    p.add_argument("--warmup", type=int, default=None, help="steps not timed (default: 2 cpu, 10 cuda)")
    p.add_argument("--accumulate", type=int, default=2, help="micro-batches per optimizer step")
    p.add_argument("--batch-size", type=int, default=None, help="per rank and micro-batch (default 8 / 64)")
    p.add_argument("--dim", type=int, default=None, help="MLP width (default: 32 cpu, 2048 cuda)")
    p.add_argument("--depth", type=int, default=None, help="hidden layers (default: 2 cpu, 8 cuda)")
    p.add_argument("--max-grad-norm", type=float, default=0.05, help="clip threshold (engages every step)")
    p.add_argument("--no-baseline", action="store_true", help="skip the framework-default run")
    p.add_argument("--out", default=None, help="scratch dir for checkpoints/logs (default: a temp dir)")
    args = p.parse_args()
    cuda = args.device == "cuda"
    if cuda and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device is visible")
    defaults = dict(precision="bf16" if cuda else "fp32", world_size=torch.cuda.device_count() if cuda else 2,
                    steps=40 if cuda else 8, warmup=10 if cuda else 2, batch_size=64 if cuda else 8,
                    dim=2048 if cuda else 32, depth=8 if cuda else 2)
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if "WORLD_SIZE" in os.environ:  # launched by torchrun (or a framework's launcher)
        args.world_size = int(os.environ["WORLD_SIZE"])
    if args.warmup >= args.steps:
        p.error(f"--warmup {args.warmup} must be below --steps {args.steps}")
    if args.out is None:
        args.out = os.path.join(os.environ.get("TMPDIR", "/tmp"), f"shardamp-{os.path.basename(sys.argv[0])[:-3]}")
    return args


def relaunch_with_torchrun(args: argparse.Namespace) -> None:
    """accelerate/transformers scripts: start ``world_size`` ranks through torchrun (its env
    vars are the real launch path) unless already one of them; returns only in a rank."""
    if args.world_size <= 1 or "LOCAL_RANK" in os.environ:
        return
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.world_size}",
           sys.argv[0], *sys.argv[1:]]
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    sys.exit(subprocess.call(cmd, env=env))


def autocast_dtype(precision: str) -> Optional[torch.dtype]:
    return {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}[precision]


class Net(nn.Module):
    def __init__(self, dim: int, depth: int) -> None:
        super().__init__()
        self.inp = nn.Linear(16, dim)
        self.hidden = nn.ModuleList(nn.Linear(dim, dim) for _ in range(depth))
        self.norm = nn.LayerNorm(dim)
        self.out = nn.Linear(dim, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.gelu(self.inp(x))
        for layer in self.hidden:
            h = h + F.gelu(layer(h))
        return self.out(self.norm(h))


def make_model(args: argparse.Namespace) -> Net:
    torch.manual_seed(0)
    return Net(args.dim, args.depth)


def loss_fn(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(out.float(), y)


def dataset_size(args: argparse.Namespace) -> int:
    return args.steps * args.accumulate * args.batch_size * args.world_size


def data(args: argparse.Namespace) -> Tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    n = dataset_size(args)
    x = torch.randn(n, 16, generator=g)
    return x, torch.tanh(x[:, :4] * 2) + 0.1 * torch.randn(n, 4, generator=g)


def decay_groups(model: nn.Module) -> List[Dict]:
    """Weight decay on matrices only: the transformers Trainer's own rule (no decay for biases
    and LayerNorm weights), so all three scripts and the reference use the same groups."""
    named = list(model.named_parameters())
    decay = [p for n, p in named if p.dim() >= 2]
    return [{"params": decay, "weight_decay": WD}, {"params": [p for n, p in named if p.dim() < 2], "weight_decay": 0.0}]


def rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def gather_indices(seen: Sequence[torch.Tensor]) -> Optional[List[List[torch.Tensor]]]:
    """Every rank's recorded micro-batch sample indices, on rank 0 (None elsewhere)."""
    mine = [t.detach().cpu() for t in seen]
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return [mine]
    out = [None] * dist.get_world_size() if rank() == 0 else None
    dist.gather_object(mine, out, dst=0)
    return out


def reference(args: argparse.Namespace, per_rank: List[List[torch.Tensor]],
              device: str) -> Tuple[List[torch.Tensor], List[float]]:
    """Unsharded torch.optim.AdamW on ``device`` fed, per step, the union of all ranks' micro-batches."""
    x, y = (t.to(device) for t in data(args))
    model = make_model(args).to(device)
    opt = torch.optim.AdamW(decay_groups(model), lr=LR, betas=BETAS, eps=EPS)
    dtype = autocast_dtype(args.precision)
    scaler = torch.amp.GradScaler(device, enabled=dtype == torch.float16)
    steps = len(per_rank[0]) // args.accumulate
    norms = []
    for s in range(steps):
        opt.zero_grad()
        micro = [r[s * args.accumulate + m] for r in per_rank for m in range(args.accumulate)]
        for idx in micro:
            idx = idx.to(device)
            with torch.autocast(device, dtype=dtype or torch.bfloat16, enabled=dtype is not None):
                loss = loss_fn(model(x[idx]), y[idx]) / len(micro)
            scaler.scale(loss).backward()
        scaler.unscale_(opt)
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm)))
        scaler.step(opt)
        scaler.update()
    return [p.detach() for p in model.parameters()], norms


def report_parity(args: argparse.Namespace, name: str, params: Sequence[torch.Tensor],
                  seen: Sequence[torch.Tensor], norms: Optional[Sequence[float]] = None) -> bool:
    """Rank 0: compare ``params`` with the reference and print one PASS/FAIL line (a collective)."""
    per_rank = gather_indices(seen)
    if rank() != 0:
        return True
    ref_params, ref_norms = reference(args, per_rank, args.device)
    rtol, atol = TOLERANCE[args.precision]
    worst = 0.0
    for a, b in zip(params, ref_params):
        a, b = a.detach().float().to(b.device), b.float()
        worst = max(worst, float(((a - b).abs() / (atol + rtol * b.abs())).max()))
    finite = [n for n in ref_norms if math.isfinite(n)]  # fp16: overflowing steps are skipped
    clipped = bool(finite) and all(n > args.max_grad_norm for n in finite)
    ok = worst <= 1.0 and clipped
    if norms is not None:  # a skipped step's norm is non-finite on both sides
        ok = ok and len(norms) == len(ref_norms) and all(
            (not math.isfinite(a) and not math.isfinite(b)) or abs(a - b) <= NORM_RTOL[args.precision] * abs(b) + 1e-6
            for a, b in zip(norms, ref_norms))
    skipped = len(ref_norms) - len(finite)
    print(f"parity vs torch.optim.AdamW ({name}, {len(ref_norms)} steps, {args.precision}, world {args.world_size}, "
          f"clipped every step: {'yes' if clipped else 'NO'}"
          + (f", {skipped} skipped on overflow" if skipped else "")
          + f"): worst |diff| / (atol + rtol |ref|) = {worst:.3f} (rtol {rtol:g}, atol {atol:g})"
          + (", logged norms match" if norms is not None else "")
          + f": {'PASS' if ok else 'FAIL'}", flush=True)
    if norms is not None and not ok:
        print(f"  norms: {list(norms)}\n  torch: {ref_norms}", flush=True)
    return ok


class StepTimer:
    """Mean wall time per optimizer step over steps [warmup, steps): one device sync at each end."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args, self.t0, self.t1 = args, None, None

    def step_done(self, step: int) -> None:  # ``step`` optimizer steps have finished
        if step in (self.args.warmup, self.args.steps):
            if self.args.device == "cuda":
                torch.cuda.synchronize()
            if step == self.args.warmup:
                self.t0 = time.perf_counter()
            else:
                self.t1 = time.perf_counter()

    @property
    def ms(self) -> float:
        if self.t0 is None or self.t1 is None:
            return float("nan")
        return (self.t1 - self.t0) * 1e3 / (self.args.steps - self.args.warmup)


def report_time(args: argparse.Namespace, framework: str, ours: float, default: Optional[float], default_name: str) -> None:
    if rank() != 0:
        return
    line = f"step time ({framework}, {args.device}, {args.precision}, world {args.world_size}): shardamp {ours:.2f} ms"
    if default is not None:
        line += f", {default_name} {default:.2f} ms ({default / ours:.2f}x)"
    print(line, flush=True)


def clean(path: str) -> None:
    if rank() == 0:
        shutil.rmtree(path, ignore_errors=True)


def start(description: str, torchrun: bool) -> argparse.Namespace:
    """Parse the flags; accelerate and the Trainer (``torchrun=True``) have no fp16 on the CPU and
    relaunch themselves under torchrun for several ranks (Lightning launches on its own)."""
    args = parse_args(description)
    if torchrun:
        if args.precision == "fp16" and args.device == "cpu":
            sys.exit("--precision fp16 needs --device cuda: accelerate has no fp16 autocast or grad scaler on "
                     "the CPU (it would silently train in fp32)")
        relaunch_with_torchrun(args)
    if args.device == "cpu":
        torch.set_num_threads(1)
    return args


def finish(args: argparse.Namespace, framework: str, ours_ms: float, baseline: Callable[[], float], ok: bool) -> None:
    """Time the framework's own default (unless ``--no-baseline``), report, clean up, exit 0 iff ``ok``."""
    default = None if args.no_baseline else baseline()
    name = "DDP + AdamW(fused)" if args.device == "cuda" else "DDP + AdamW"
    report_time(args, framework, ours_ms, default, name)
    clean(args.out)
    sys.exit(0 if ok else 1)
