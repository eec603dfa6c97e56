"""A small, host-bound model's whole iteration on the CPU: shardamp against torch's fastest AdamW.

The model is a 263K-param MLP (``Linear(256, 512)``, GELU, ``Linear(512, 256)``, batch 32, fp32):
its forward, backward and step take a few hundred microseconds, so an iteration measures the
optimizer's fixed host cost per step as much as its math. World 1 and no process group (a user's
first script on one machine). Each side runs the same iteration: ``zero_grad``, forward,
backward, clip to norm 1.0, step (``--loop plain``: no clip). ``--groups 2``: two param groups,
weight decay on the matrices only (``examples/framework_common.decay_groups``: the frameworks'
rule, the transformers Trainer's), whose per-group norms shardamp forms every step.

* ``torch fused``: ``torch.optim.AdamW(fused=True)`` + ``torch.nn.utils.clip_grad_norm_``;
* ``torch foreach``: ``torch.optim.AdamW(foreach=True)`` + ``clip_grad_norm_``;
* ``shardamp``: ``DistributedFusedAdam`` + ``opt.clip_grad_norm``.

Rounds are interleaved (every side runs ``--iters`` iterations per round, the order rotating
from round to round); the row's speed is torch's time over shardamp's (>= 1.00: shardamp is no
slower): the median of each side's per-iteration time, and the geometric mean of the rounds'
paired ratios with its 95% t-interval (``host_iteration.paired_ratio``), against each torch side
and against the faster of the two (by median). One thread by default (``--threads``).
``--phases``: one more interleaved run, each phase's host time (median microseconds).

    python benchmarks/bench_small_cpu.py --rounds 15 --iters 200
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional

import torch
import torch.nn as nn

from host_iteration import paired_ratio
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from framework_common import decay_groups  # noqa: E402  (the frameworks' two groups)
from shardamp.optim import DistributedFusedAdam  # noqa: E402

SIDES = ("torch fused", "torch foreach", "shardamp")
PHASES = ("zero_grad", "forward", "backward", "clip", "step")


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(256, 512), nn.GELU(), nn.Linear(512, 256))


def param_groups(model: nn.Module, groups: int) -> List[Dict]:
    """One group (weight decay 0.01 on every param), or the examples' two (``decay_groups``)."""
    return [{"params": list(model.parameters()), "weight_decay": 0.01}] if groups == 1 else decay_groups(model)


def make_iteration(side: str, clip: bool, batch: int, groups: int = 1) -> Callable[..., None]:
    """One whole iteration of ``side`` (its model, optimizer and data built here); given a dict
    of lists, it appends each phase's host microseconds to them (perf_counter between phases)."""
    model = make_model()
    gen = torch.Generator().manual_seed(1)
    x, y = torch.randn(batch, 256, generator=gen), torch.randn(batch, 256, generator=gen)
    params = list(model.parameters())
    if side == "shardamp":
        opt = DistributedFusedAdam(param_groups(model, groups), lr=1e-3)
        clip_fn = lambda: opt.clip_grad_norm(1.0)  # noqa: E731
    else:
        opt = torch.optim.AdamW(param_groups(model, groups), lr=1e-3, **{side.split()[1]: True})
        clip_fn = lambda: torch.nn.utils.clip_grad_norm_(params, 1.0, foreach=True)  # noqa: E731

    def one(phases: Optional[Dict[str, List[float]]] = None) -> None:
        if phases is None:
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            if clip:
                clip_fn()
            opt.step()
            return
        t0 = time.perf_counter()
        opt.zero_grad()
        t1 = time.perf_counter()
        loss = torch.nn.functional.mse_loss(model(x), y)
        t2 = time.perf_counter()
        loss.backward()
        t3 = time.perf_counter()
        if clip:
            clip_fn()
        t4 = time.perf_counter()
        opt.step()
        t5 = time.perf_counter()
        for name, a, b in zip(PHASES, (t0, t1, t2, t3, t4), (t1, t2, t3, t4, t5)):
            phases[name].append((b - a) * 1e6)

    return one


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--iters", type=int, default=200, help="iterations per side and round")
    ap.add_argument("--warmup", type=int, default=50)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--loop", choices=("clip", "plain"), default="clip")
    ap.add_argument("--groups", type=int, choices=(1, 2), default=1,
                    help="param groups: 2 puts weight decay on the matrices only (the frameworks' rule)")
    ap.add_argument("--phases", action="store_true",
                    help="then one more interleaved run timing each phase (median us per phase and side)")
    ap.add_argument("--json", default="", help="write the row here")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    fns = {side: make_iteration(side, args.loop == "clip", args.batch, args.groups) for side in SIDES}
    for fn in fns.values():
        for _ in range(args.warmup):
            fn()
    runs: Dict[str, List[float]] = {side: [] for side in SIDES}
    for r in range(args.rounds):
        order = SIDES[r % len(SIDES):] + SIDES[:r % len(SIDES)]
        for side in order:
            fn = fns[side]
            t0 = time.perf_counter()
            for _ in range(args.iters):
                fn()
            runs[side].append((time.perf_counter() - t0) / args.iters * 1e6)
    us = {side: statistics.median(v) for side, v in runs.items()}
    fastest = min(("torch fused", "torch foreach"), key=us.get)
    row = dict(loop=args.loop, groups=args.groups, threads=args.threads, rounds=args.rounds, iters=args.iters,
               torch=torch.__version__,
               params=sum(p.numel() for p in make_model().parameters()), us=us, runs=runs, fastest_torch=fastest,
               ratios={t: paired_ratio(runs[t], runs["shardamp"]) for t in ("torch fused", "torch foreach")})
    print(f"{row['params']} params, {args.groups} param group(s), loop {args.loop}, {args.threads} thread(s), "
          f"{args.rounds} rounds x {args.iters} iterations, torch {torch.__version__}")
    for side in SIDES:
        print(f"  {side:14s} {us[side]:8.1f} us/iteration")
    for t in ("torch fused", "torch foreach"):
        g, lo, hi = row["ratios"][t]
        mark = "  <- torch's fastest" if t == fastest else ""
        print(f"  {t} / shardamp: {us[t] / us['shardamp']:.3f}x (paired {g:.3f} [{lo:.3f}-{hi:.3f}]){mark}")
    if args.phases:  # the marks cost ~1 us a phase: a separate run, not the ratios' rounds
        phases = {side: {name: [] for name in PHASES} for side in SIDES}
        for r in range(args.rounds):
            for side in SIDES[r % len(SIDES):] + SIDES[:r % len(SIDES)]:
                for _ in range(args.iters):
                    fns[side](phases[side])
        row["phases"] = {side: {name: statistics.median(v) for name, v in p.items()} for side, p in phases.items()}
        print("  phase medians (us): " + ", ".join(PHASES))
        for side in SIDES:
            print(f"  {side:14s} " + " ".join(f"{row['phases'][side][name]:8.1f}" for name in PHASES))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(row, indent=1))


if __name__ == "__main__":
    main()
