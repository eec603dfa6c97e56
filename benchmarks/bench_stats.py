"""The step's stats all-reduce with the step's health in it: its size and the time to build and
reduce it, for a model of many params (default 10,000 param tensors) on the CPU at world 2.

    python benchmarks/bench_stats.py                       # 10,000 params, world 2, gloo
    python benchmarks/bench_stats.py --params 1000 --repeats 50 --json out/stats.json

Spawns ``--world`` gloo ranks (file rendezvous, no ports). Per configuration (one param group;
two groups, decay / no decay, interleaved as in a transformer) every rank times, as
``DistributedFusedAdam._ensure_stats`` does them:

* ``build``: the stats tensor (one cat of the header, the touched flags, the health entries and
  the agreement entries) and its norm partials (one pass over this rank's grad shards), plus,
  with several groups, the per-group partials (one more pass, one call per bucket);
* ``reduce``: the one all-reduce;
* ``finish``: norm, found-inf and touched flags from it (one native call) and the agreement check;
* ``landing check``: backward's per-param non-finite flags of this rank's grads before their
  reduce-scatter (one pass over each full-size bucket buffer; not on the step path);
* ``step``: a whole ``opt.step()`` (for scale), each a median over ``--repeats`` after warm-up.

The size is reported with and without the health entries (1 + G floats when G > 1, else 1).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from typing import Any, Dict

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn


def _median_us(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def _model(n_params: int) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Module()
    # small params of a few shapes (weights and biases of a many-layer model)
    model.ps = nn.ParameterList(nn.Parameter(torch.randn(32 if i % 2 else 8, 4 if i % 2 else 1).squeeze(-1) * 0.1)
                                for i in range(n_params))
    return model


def _groups(model: nn.Module, two: bool) -> Any:
    named = list(model.named_parameters())
    if not two:
        return named
    decay = [(n, p) for n, p in named if p.dim() > 1]
    rest = [(n, p) for n, p in named if p.dim() <= 1]
    return [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}]


def _backward(model: nn.Module, rank: int) -> None:
    loss = sum((p * (rank + 1.0)).sum() for p in model.parameters())
    loss.backward()


def _rank(rank: int, world: int, init: str, args: Dict[str, Any], out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    from shardamp.optim import DistributedFusedAdam, kernels, norms
    from shardamp.optim.checks import agreement
    from shardamp.optim.kernels import partials
    from shardamp.optim.step import grad_stats
    from shardamp.optim.step.grad_stats import HEADER

    results = []
    for two in (False, True):
        model = _model(args["params"])
        opt = DistributedFusedAdam(_groups(model, two), lr=1e-3, bucket_cap_mb=args["bucket_cap_mb"])
        health = opt._health
        n = len(opt._params)
        for _ in range(3):  # warm-up: full steps
            opt.zero_grad()
            _backward(model, rank)
            opt.step()
        opt.zero_grad()
        _backward(model, rank)
        opt.grad_sync()
        buffers, buckets = opt._buffers, opt._buckets
        offset = HEADER + n
        groups = health.group_slice(offset)
        state: Dict[str, Any] = {}

        def build() -> None:
            buf, checked, _ = agreement.stats_buffer(opt._step_view, 2.0, "", None, health.entries())
            partials.partial([b.grad_shard for b in buffers], 2.0, buf, zeroed=True)
            if groups is not None:
                for bucket, b in zip(buckets, buffers):
                    kernels.group_partials(b.grad_shard, bucket.segments, buf[groups], 2.0, n)
            state["buf"], state["checked"] = buf, checked

        def reduce() -> None:
            work = state["buf"].clone()
            dist.barrier()  # every rank enters together: the time is the all-reduce's, not the skew's
            t0 = time.perf_counter()
            opt._reduce_grad_stats(work, norms.reduce_op(2.0))
            state["reduce_s"] = time.perf_counter() - t0
            state["reduced"] = work

        def finish() -> None:
            stats = grad_stats.finish(state["reduced"].clone(), 2.0, n, opt._step_view.fingerprint if state["checked"] else None,
                                      health.n_entries)
            if stats.disagreement is not None:
                stats.disagreement.tolist()  # the CPU reads the agreement flags at once

        fulls = [torch.zeros(b.numel, dtype=b.dtype) for b in buckets]

        def landing() -> None:
            for i, full in enumerate(fulls):
                kernels.nonfinite_flags(full, health.rows[i], health.flags)

        build()
        reduce_times = []
        for _ in range(args["repeats"]):
            reduce()
            reduce_times.append(state["reduce_s"])

        def step() -> None:
            opt.step()

        row = {
            "groups": len(opt.param_groups), "params": n, "buckets": len(buckets), "world": world,
            "stats_floats": int(state["buf"].numel()), "stats_bytes": int(state["buf"].numel()) * 4,
            "health_floats": health.n_entries,
            "stats_floats_without_health": int(state["buf"].numel()) - health.n_entries,
            "build_us": _median_us(build, args["repeats"]),
            "reduce_us": statistics.median(reduce_times) * 1e6,
            "finish_us": _median_us(finish, args["repeats"]),
            "landing_check_us": _median_us(landing, args["repeats"]),
        }
        step_times = []
        for _ in range(args["repeats"]):
            opt.zero_grad()
            _backward(model, rank)
            dist.barrier()
            t0 = time.perf_counter()
            step()
            step_times.append(time.perf_counter() - t0)
        row["step_us"] = statistics.median(step_times) * 1e6
        results.append(row)
        del opt, health, state
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(results, f)
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--params", type=int, default=10_000, help="param tensors in the model")
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--bucket-cap-mb", type=float, default=25.0)
    parser.add_argument("--json", default="", help="also write every rank's rows here")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        init = os.path.join(tmp, "rendezvous")
        mp.start_processes(_rank, args=(args.world, init, vars(args), tmp), nprocs=args.world, start_method="spawn")
        rows = [json.load(open(os.path.join(tmp, f"rank{r}.json"))) for r in range(args.world)]
    print(f"torch {torch.__version__}, CPU, gloo, world {args.world}, {args.params} param tensors, "
          f"median of {args.repeats}, microseconds (rank 0; rank 1 in brackets)")
    header = ("groups", "stats floats (bytes)", "of which health", "build", "reduce", "finish", "landing check", "step")
    print(" | ".join(header))
    for r0, r1 in zip(rows[0], rows[1] if len(rows) > 1 else rows[0]):
        print(f"{r0['groups']} | {r0['stats_floats']} ({r0['stats_bytes']} B) | {r0['health_floats']} | "
              f"{r0['build_us']:.0f} ({r1['build_us']:.0f}) | {r0['reduce_us']:.0f} ({r1['reduce_us']:.0f}) | "
              f"{r0['finish_us']:.0f} ({r1['finish_us']:.0f}) | {r0['landing_check_us']:.0f} "
              f"({r1['landing_check_us']:.0f}) | {r0['step_us']:.0f} ({r1['step_us']:.0f})")
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
