"""Shared by examples/{lightning,accelerate,transformers}_train.py: flags, the model and its data,
the parity check against unsharded torch.optim.AdamW, and step timing.

Each script trains the same MLP regression twice under its framework: once with the shardamp
integration (one changed line) and once with the framework's own default (DDP + torch AdamW,
fused on CUDA), then prints:

* ``parity vs torch.optim.AdamW (...)``: the shardamp run against THE reference, AdamW (torch's
  default implementation) + ``clip_grad_norm_`` (+ ``torch.amp.GradScaler`` for fp16) on one
  process, fed at every step the union of the micro-batches all ranks saw (recorded by sample
  index, so nothing syncs while timing), each micro-batch in the same autocast dtype;
* ``step time``: mean wall time per optimizer step after warm-up, shardamp vs the default.

The parity criterion. Training is chaotic at the CUDA default (33M params, lr 1e-3, clipped
every step, grad norm 18 -> 450 -> 3): an ulp of difference at step 1 grows to far beyond any
fixed tolerance, for torch against itself too (measured on the CPU with benchmarks/parity_floor.py:
its fused AdamW against its foreach one, same norm, 116x the fp32 tolerance after 40 steps; its
fused or fp64-norm variants against its default, 1.6-2.3x the bf16 tolerance after 6 bf16 steps
and 98-114x after 40; on an H200, fp32, 40 steps: fused 76x and 265x in two runs, where
shardamp was at 30x and 50x). So the check measures that noise floor in the same run, from
three more reference runs that round the same math differently (AdamW
``fused=True``; the clipping norm summed in fp64; both), and two wrong ones (lr x1.01, clipping
off). Deviation is measured two ways (``Deviation``): the worst element |a - b| / (atol + rtol
|b|) and the drift, max over tensors of ||a - b|| / ||b - b_init||. PASS needs all of:

A. after the first step torch did not skip (of the first ``SNAPSHOT_STEPS``; nothing has drifted
   yet): worst <= max(1, FLOOR_K x floor) at the fp32 tolerance (rtol 1e-4, atol 1e-6) in every
   precision, drift <= max(DRIFT_TOL, FLOOR_K x floor), and both wrong runs fail that bound
   (lr x1.01 is ~10 there, no clipping far more: the check demonstrably can fail);
B. after the last step: worst <= max(1, FLOOR_K x floor) at the precision's TOLERANCE and drift
   <= max(DRIFT_TOL, FLOOR_K x floor), the floor being the largest deviation of the three torch
   variants (the wrong runs' deviations are printed: outside the bound, except where the floor
   has grown past a 1% lr change, as in long bf16 runs);
C. the logged norms (accelerate, Trainer), each step: relative error <= max(NORM_RTOL, FLOOR_K x
   the torch variants' largest error so far);
D. clipping engaged on every step of the reference.

On the small CPU default the floor is tiny and A/B reduce to the fixed tolerances.
"""
from __future__ import annotations

import argparse
import hashlib
import math
import os
import shutil
import subprocess
import sys
import time
from typing import Callable, Dict, Iterable, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

LR, BETAS, EPS, WD = 1e-3, (0.9, 0.95), 1e-8, 0.1
TOLERANCE = {"fp32": (1e-4, 1e-6), "bf16": (1e-3, 1e-4), "fp16": (1e-3, 1e-4)}  # params: rtol, atol
DRIFT_TOL = 1e-3  # params: ||diff|| / ||how far training moved||
SNAPSHOT_STEPS = 3  # the short-horizon check looks at the first of these steps that torch did not skip
FLOOR_K = 10.0  # a correct run deviates at most this many times more than torch's own implementations
# norms, relative: fp16 grads of a loss divided by the micro-batch count here and by the rank count
# after the reduction there underflow slightly differently (powers of two, but fp16 subnormals)
NORM_RTOL = {"fp32": 1e-4, "bf16": 1e-4, "fp16": 2e-3}


def parse_args(description: str, add_args: Optional[Callable[[argparse.ArgumentParser], None]] = None
               ) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=description)
    if add_args is not None:  # a script's own flags
        add_args(p)
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


def _clip(params: List[torch.Tensor], max_norm: float, exact_norm: bool) -> torch.Tensor:
    """torch's clip_grad_norm_, or the same formula with the norm summed in fp64 (``exact_norm``):
    a second, legitimately different rounding of the same clipping."""
    if not exact_norm:
        return torch.nn.utils.clip_grad_norm_(params, max_norm)
    grads = [p.grad for p in params if p.grad is not None]
    norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g, dtype=torch.float64) for g in grads]))
    coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    torch._foreach_mul_(grads, coef.float())
    return norm


def reference(args: argparse.Namespace, per_rank: List[List[torch.Tensor]], device: str, fused: bool = False,
              exact_norm: bool = False, lr_scale: float = 1.0,
              clip: bool = True) -> Tuple[List[torch.Tensor], List[float], List[List[torch.Tensor]]]:
    """Unsharded torch.optim.AdamW on ``device`` fed, per step, the union of all ranks' micro-batches.

    The defaults are THE reference: torch's default AdamW implementation (foreach on CUDA, the
    for-loop on the CPU) and ``torch.nn.utils.clip_grad_norm_``. ``fused``/``exact_norm`` give
    torch's other roundings of the same math (its fused kernel; the norm summed in fp64), whose
    spread from the reference is the noise floor; ``lr_scale``/``clip=False`` are wrong runs the
    check must reject. Returns the final params, each step's pre-clip norm and the params after
    each of the first ``SNAPSHOT_STEPS`` steps."""
    x, y = (t.to(device) for t in data(args))
    model = make_model(args).to(device)
    opt = torch.optim.AdamW(decay_groups(model), lr=LR * lr_scale, betas=BETAS, eps=EPS, **({"fused": True} if fused else {}))
    dtype = autocast_dtype(args.precision)
    scaler = torch.amp.GradScaler(device, enabled=dtype == torch.float16)
    steps = len(per_rank[0]) // args.accumulate
    norms, snapshots = [], []
    for s in range(steps):
        opt.zero_grad()
        micro = [r[s * args.accumulate + m] for r in per_rank for m in range(args.accumulate)]
        for idx in micro:
            idx = idx.to(device)
            with torch.autocast(device, dtype=dtype or torch.bfloat16, enabled=dtype is not None):
                loss = loss_fn(model(x[idx]), y[idx]) / len(micro)
            scaler.scale(loss).backward()
        scaler.unscale_(opt)
        norms.append(float(_clip(list(model.parameters()), args.max_grad_norm if clip else math.inf, exact_norm)))
        scaler.step(opt)
        scaler.update()
        if s < SNAPSHOT_STEPS:
            snapshots.append([p.detach().clone() for p in model.parameters()])
    return [p.detach() for p in model.parameters()], norms, snapshots


class Snapshots:
    """The params after each of the first ``SNAPSHOT_STEPS`` optimizer steps, for the short-horizon
    check; ``step_done(step, params)`` is called where StepTimer's is."""

    def __init__(self) -> None:
        self.params: List[List[torch.Tensor]] = []

    def step_done(self, step: int, params: Iterable[torch.Tensor]) -> None:
        if step == len(self.params) + 1 and step <= SNAPSHOT_STEPS:
            self.params.append([p.detach().clone() for p in params])


class Deviation:
    """How far a run's final params are from the reference's, two ways:

    * ``worst``: max over elements of |a - b| / (atol + rtol |b|) (torch.allclose passes at <= 1);
    * ``drift``: max over tensors of ||a - b|| / ||b - b0||, the difference relative to how far
      training moved that tensor from its init b0 (a 1% wrong lr gives about 1e-2 on every tensor).
    """

    def __init__(self, params: Sequence[torch.Tensor], ref: Sequence[torch.Tensor], init: Sequence[torch.Tensor],
                 names: Sequence[str], rtol: float, atol: float) -> None:
        self.worst, self.drift, self.where = 0.0, 0.0, ""
        for name, a, b, b0 in zip(names, params, ref, init):
            a, b, b0 = a.detach().float().to(b.device), b.float(), b0.float().to(b.device)
            ratio = (a - b).abs() / (atol + rtol * b.abs())
            if float(ratio.max()) > self.worst:
                i = int(ratio.argmax())
                self.worst = float(ratio.max())
                self.where = f"{name}[{i}]: {float(a.flatten()[i]):.6e} vs torch {float(b.flatten()[i]):.6e}"
            diff, moved = float((a - b).norm()), float((b - b0).norm())
            self.drift = max(self.drift, diff / moved if moved > 0 else (0.0 if diff == 0 else math.inf))

    def within(self, bound: "Bound") -> bool:
        return self.worst <= bound.worst and self.drift <= bound.drift


class Bound:
    """What a correct run may deviate by: the tight tolerance, or ``FLOOR_K`` times the largest
    deviation among torch's own implementations, whichever is larger."""

    def __init__(self, floor: Sequence[Deviation], precision: str) -> None:
        self.floor_worst = max((d.worst for d in floor), default=0.0)
        self.floor_drift = max((d.drift for d in floor), default=0.0)
        self.worst = max(1.0, FLOOR_K * self.floor_worst)
        self.drift = max(DRIFT_TOL, FLOOR_K * self.floor_drift)


def _norm_errors(norms: Sequence[float], ref: Sequence[float]) -> List[float]:
    """Relative error per step (0 where both are non-finite: an overflow both skipped)."""
    out = []
    for a, b in zip(norms, ref):
        if not math.isfinite(a) and not math.isfinite(b):
            out.append(0.0)
        elif not (math.isfinite(a) and math.isfinite(b)):
            out.append(math.inf)
        else:
            out.append(abs(a - b) / max(abs(b), 1e-12))
    return out


def _norms_within(norms: Sequence[float], ref: Sequence[float], floors: Sequence[Sequence[float]],
                  precision: str) -> Tuple[bool, float, float]:
    """Per step: error <= max(NORM_RTOL, FLOOR_K x the largest floor error up to that step)
    (the floor grows as the trajectories drift apart). Returns (ok, worst error, its bound)."""
    if len(norms) != len(ref):
        return False, math.inf, 0.0
    errors = _norm_errors(norms, ref)
    floor_errors = [_norm_errors(f, ref) for f in floors]
    ok, envelope, worst, worst_bound = True, 0.0, 0.0, NORM_RTOL[precision]
    for t, e in enumerate(errors):
        envelope = max([envelope] + [f[t] for f in floor_errors if math.isfinite(f[t])])
        bound = max(NORM_RTOL[precision], FLOOR_K * envelope)
        ok = ok and e <= bound
        if e >= worst:
            worst, worst_bound = e, bound
    return ok, worst, worst_bound


def digest(params: Sequence[torch.Tensor]) -> str:
    """A short hash of the params' bytes: equal digests mean bit-identical training."""
    h = hashlib.sha1()
    for p in params:
        h.update(p.detach().float().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()[:10]


def _first_update(norms: Sequence[float], available: int) -> Optional[int]:
    """Index of the first snapshot step torch did not skip on overflow (fp16), if any."""
    return next((s for s in range(min(available, len(norms))) if math.isfinite(norms[s])), None)


def report_parity(args: argparse.Namespace, name: str, params: Sequence[torch.Tensor], seen: Sequence[torch.Tensor],
                  norms: Optional[Sequence[float]] = None,
                  snapshots: Optional[Sequence[Sequence[torch.Tensor]]] = None) -> bool:
    """Rank 0: judge ``params`` (and the logged ``norms``, and the early ``snapshots``) against the
    reference by the criterion of the module docstring; print a PASS/FAIL line and its numbers
    (a collective: every rank calls it)."""
    per_rank = gather_indices(seen)
    if rank() != 0:
        return True
    variants = {"fused": dict(fused=True), "fp64 norm": dict(exact_norm=True),
                "fused + fp64 norm": dict(fused=True, exact_norm=True)}
    wrong = {"lr x1.01": dict(lr_scale=1.01), "no clipping": dict(clip=False)}
    ref_params, ref_norms, ref_snaps = reference(args, per_rank, args.device)
    runs = {k: reference(args, per_rank, args.device, **kw) for k, kw in {**variants, **wrong}.items()}
    init = [p.detach() for p in make_model(args).parameters()]
    names = [n for n, _ in make_model(args).named_parameters()]

    def judge(mine: Sequence[torch.Tensor], theirs: Callable[[Tuple], Sequence[torch.Tensor]],
              ref: Sequence[torch.Tensor], precision: str) -> Tuple[Deviation, Bound, Dict[str, Deviation]]:
        rtol, atol = TOLERANCE[precision]
        devs = {k: Deviation(theirs(run), ref, init, names, rtol, atol) for k, run in runs.items()}
        return Deviation(mine, ref, init, names, rtol, atol), Bound([devs[k] for k in variants], precision), devs

    # A. the first step(s): nothing has drifted yet, so the fp32 tolerance holds in every precision
    s = _first_update(ref_norms, min(len(ref_snaps), len(snapshots or [])))
    if s is not None:
        early, early_bound, early_devs = judge(snapshots[s], lambda run: run[2][s], ref_snaps[s], "fp32")
        early_rejects = {k: not early_devs[k].within(early_bound) for k in wrong}
        early_ok = early.within(early_bound) and all(early_rejects.values())
    else:
        early_ok = False
    # B. the whole run: the precision's tolerance, or FLOOR_K x torch's own spread
    ours, bound, devs = judge(params, lambda run: run[0], ref_params, args.precision)
    final_ok = ours.within(bound)
    finite = [n for n in ref_norms if math.isfinite(n)]  # fp16: overflowing steps are skipped
    clipped = bool(finite) and all(n > args.max_grad_norm for n in finite)
    ok = clipped and early_ok and final_ok
    norms_line = ""
    if norms is not None:  # C. the logged norms, step by step against the same kind of bound
        norms_ok, worst_norm, norm_bound = _norms_within(norms, ref_norms, [runs[k][1] for k in variants],
                                                         args.precision)
        ok = ok and norms_ok
        norms_line = f"; logged norms {'match' if norms_ok else 'DIFFER'} (worst rel. {worst_norm:.1e} <= {norm_bound:.1e})"
    skipped = len(ref_norms) - len(finite)
    rtol, atol = TOLERANCE[args.precision]
    head = (f"parity vs torch.optim.AdamW ({name}, {len(ref_norms)} steps, {args.precision}, world {args.world_size}, "
            f"clipped every step: {'yes' if clipped else 'NO'}" + (f", {skipped} skipped on overflow" if skipped else ""))
    if s is None:
        early_line = f"no snapshot of an unskipped step among the first {SNAPSHOT_STEPS}: NOT CHECKED"
    else:
        early_line = (f"after step {s + 1}: worst {early.worst:.3f} <= {early_bound.worst:.3g} (rtol 1e-4, atol 1e-6), "
                      f"drift {early.drift:.1e} <= {early_bound.drift:.1e}, rejects "
                      + ", ".join(f"{k} ({early_devs[k].worst:.3g})" if early_rejects[k] else f"NOT {k}" for k in wrong))
    print(f"{head}): {early_line}; after step {len(ref_norms)}: worst {ours.worst:.3f} <= {bound.worst:.3g} "
          f"(rtol {rtol:g}, atol {atol:g}), drift {ours.drift:.1e} <= {bound.drift:.1e}{norms_line}: "
          f"{'PASS' if ok else 'FAIL'}", flush=True)
    print(f"  torch's own spread after step {len(ref_norms)} (worst / drift): "
          + ", ".join(f"{k} {devs[k].worst:.3f} / {devs[k].drift:.1e}" for k in variants)
          + "; the wrong runs: " + ", ".join(
              f"{k} {devs[k].worst:.3g} / {devs[k].drift:.1e} ({'outside' if not devs[k].within(bound) else 'inside'})"
              for k in wrong), flush=True)
    print(f"  worst element {ours.where}; params digest {digest(params)}", flush=True)
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


def start(description: str, torchrun: bool,
          add_args: Optional[Callable[[argparse.ArgumentParser], None]] = None) -> argparse.Namespace:
    """Parse the flags (``add_args`` adds a script's own); accelerate and the Trainer
    (``torchrun=True``) have no fp16 on the CPU and relaunch themselves under torchrun for several
    ranks (Lightning launches on its own)."""
    args = parse_args(description, add_args)
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
    shut_down()
    sys.exit(0 if ok else 1)


def shut_down() -> None:
    """Destroy the process group before the interpreter exits, as torch asks every program to
    (accelerate's ``end_training`` does the same): a gloo group left to interpreter finalization
    can abort its process ("terminate called without an active exception", SIGABRT) while its
    worker threads are torn down. The barrier keeps a rank from leaving while another still
    talks to it."""
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
