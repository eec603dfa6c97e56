"""Where in Lightning's iteration a route's host time goes: the time between the Trainer's own
hooks, per route, in interleaved rounds.

lightning_share.py says how much Lightning's iteration costs on each optimizer's route; this
says in which part of it. A callback stamps the host clock at each hook Lightning calls in a
training batch, in the automatic order (``on_train_batch_start``, the forward,
``on_before_zero_grad``, ``zero_grad``, ``on_before_backward``, the backward,
``on_after_backward``, what Lightning does before the step, ``on_before_optimizer_step``, the
step, ``on_train_batch_end``, the loop to the next batch), so each phase is the host time between
two stamps (the callback's own calls are in every route alike). Routes: torch's AdamW under
``strategy="auto"``, DistributedFusedAdam under ``ShardampStrategy(log_step_stats=False)``, and
DistributedFusedAdam under ``strategy="auto"``. The workload
is lightning_share's (bench_frameworks' MLP, ``bf16-mixed``, one device). Printed: per phase, the
median over the rounds of each round's median, in microseconds.

    python benchmarks/lightning_phases.py --device cuda --rounds 5
    python benchmarks/lightning_phases.py --device cpu --rounds 3 --iters 300
"""
from __future__ import annotations

import argparse
import datetime
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Dict, List

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from lightning_share import (Setup, _timed, common_args, make_module, make_trainer, setup_from,  # noqa: E402
                             strategy_of)  # its workload, Trainer and arguments

MARKS = ("on_train_batch_start", "on_before_zero_grad", "on_before_backward", "on_after_backward",
         "on_before_optimizer_step", "on_train_batch_end")
PHASES = ("forward", "zero_grad", "backward", "before the step", "step", "to the next batch")
ROUTES = ("torch", "shardamp-no-monitor", "shardamp-auto")


def phases(route: str, s: Setup) -> Dict[str, float]:
    """One Trainer run of ``route``: each phase's median host us over the iterations after the warm-up."""
    import lightning.pytorch as pl

    done: List[List[float]] = []
    current: List[float] = []

    def stamp(name: str) -> Any:
        def hook(self: Any, *args: Any, **kwargs: Any) -> None:
            now = time.perf_counter()
            if name == MARKS[0]:
                if len(current) == len(MARKS):  # the last batch's stamps, closed by this one
                    done.append(current + [now])
                current.clear()
            current.append(now)
        return hook

    stamps = type("Stamps", (pl.Callback,), {name: stamp(name) for name in MARKS})
    trainer = make_trainer(strategy_of(route), s, [stamps()])
    module = make_module("torch" if route == "torch" else "shardamp", s)
    _timed(lambda: trainer.fit(module, s.loader()))
    rows = done[s.warmup:]
    if not rows:
        raise RuntimeError(f"lightning_phases: route {route} recorded no whole iteration (hooks not called in order)")
    return {p: statistics.median((r[i + 1] - r[i]) * 1e6 for r in rows) for i, p in enumerate(PHASES)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    common_args(ap)
    args = ap.parse_args()
    s = setup_from(args)
    got: Dict[str, List[Dict[str, float]]] = {r: [] for r in ROUTES}
    for i in range(args.rounds):
        for route in ROUTES[i % len(ROUTES):] + ROUTES[:i % len(ROUTES)]:  # the order rotates
            got[route].append(phases(route, s))
            if dist.is_initialized():  # ShardampStrategy's group outlives its Trainer
                dist.destroy_process_group()
    name = torch.cuda.get_device_name(s.device) if s.cuda else "cpu"
    print(f"lightning_phases on {name}, torch {torch.__version__}, {datetime.date.today()}: "
          f"{s.work.params():,} params, bf16-mixed, {args.rounds} rounds x {args.iters} iterations; host us a phase "
          "(median of the rounds' medians)")
    print(f"  {'phase':20s}" + "".join(f"{r:>21s}" for r in ROUTES))
    for p in PHASES + ("sum",):
        cells = [statistics.median(sum(x.values()) if p == "sum" else x[p] for x in got[r]) for r in ROUTES]
        print(f"  {p:20s}" + "".join(f"{c:21.1f}" for c in cells))


if __name__ == "__main__":
    main()
