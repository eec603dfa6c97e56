"""Where a host-bound iteration's time goes, phase by phase, torch against shardamp at world 1.

For one of bench_host's models (the examples' MLP by default: its GPU work is well under a
millisecond, so an iteration is the host's time) and each AMP loop asked for:

1. the host time of each phase (zero_grad, forward, backward, unscale_, clip, step, update:
   perf_counter between the marks, no synchronization), torch and shardamp in interleaved rounds,
   the median of each phase over the rounds, and their difference;
2. shardamp's own functions inside those phases (the backward's bucket callbacks, the step's
   statistics, scalar launch and deferred checks), inclusive microseconds and calls per
   iteration, timed by wrapping them for one more run (the wrappers cost ~1 us a call: the
   numbers attribute the time, the rounds above measure it).

``--variant NAME`` (one of host_iteration.VARIANTS, e.g. ``python-hooks``) adds that shardamp
variant as a third side of the same rounds, with its difference from the default per phase.

Run: ``python benchmarks/host_phases.py --device cuda`` (``--loops "plain step"``, ``--iters``,
``--rounds``; ``--device cpu`` is a smoke run on bench_host's small models).
"""
from __future__ import annotations

import argparse
import functools
import gc
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Tuple

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parents[1] / "examples"))
from host_iteration import VARIANTS, host_pieces, make_iteration  # noqa: E402
from host_models import build_model, model_specs  # noqa: E402

# shardamp's functions timed in part 2: (module path, owner or None for a module function, name)
TIMED = [
    ("shardamp.optim.sync.grad_sync", "GradSync", n)
    for n in ("on_event", "_begin", "on_grad", "_flush", "_arm_plan", "prearm",
              "_take_planned", "_launch", "end_of_backward", "quiet_end", "_adopt_all", "_finish_round", "zero",
              "flush_all", "sync")
] + [
    ("shardamp.optim.sync.grad_state", "BucketGrads", "land_first"),
] + [
    ("shardamp.optim.distributed_fused_adam", "DistributedFusedAdam", n) for n in ("zero_grad", "_ensure_stats", "step")
] + [
    ("shardamp.optim.checks.deferred", "DeferredChecks", n) for n in ("check_last_step", "record_step", "record_target")
] + [
    ("shardamp.optim.step.health", "StepHealth", n) for n in ("step_args", "stepped")
] + [
    ("shardamp.optim.step.grad_stats", None, "reduce_step_stats"),
    ("shardamp.optim.kernels.fused_step", None, "step_launch"),
    ("shardamp.optim.kernels.fused_step", None, "stats_step"),
    ("shardamp.optim.distributed_fused_adam", None, "check_views"),
]


def _wrap_all(acc: Dict[str, List[float]]) -> List[Tuple[Any, str, Any]]:
    """Wrap every TIMED function with a timer into ``acc``; returns what to put back."""
    import importlib

    saved = []
    for module, owner_name, name in TIMED:
        mod = importlib.import_module(module)
        owner = getattr(mod, owner_name) if owner_name else mod
        fn = getattr(owner, name, None)
        if fn is None:
            continue
        label = f"{owner_name or module.rsplit('.', 1)[-1]}.{name}"

        def timed(*a, _fn=fn, _label=label, **k):
            t = time.perf_counter()
            try:
                return _fn(*a, **k)
            finally:
                e = acc.setdefault(_label, [0.0, 0])
                e[0] += time.perf_counter() - t
                e[1] += 1

        setattr(owner, name, functools.wraps(fn)(timed))  # module functions: called through their module
        saved.append((owner, name, fn))
    return saved


def phases(fns: Dict[str, Callable[..., None]], device: torch.device, iters: int, rounds: int
           ) -> Dict[str, Dict[str, float]]:
    """Median host us of each phase per implementation over ``rounds`` interleaved rounds."""
    per: Dict[str, List[Dict[str, float]]] = {k: [] for k in fns}
    names = list(fns)
    for r in range(rounds):
        for k in (names if r % 2 == 0 else names[::-1]):
            per[k].append(host_pieces(fns[k], iters))
            if device.type == "cuda":
                torch.cuda.synchronize(device)
    out: Dict[str, Dict[str, float]] = {}
    for k, runs in per.items():
        out[k] = {ph: statistics.median(run[ph] for run in runs) for ph in runs[0]}
        out[k]["total"] = statistics.median(sum(run.values()) for run in runs)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--model", default="mlp bf16", help="one of bench_host's model rows")
    ap.add_argument("--loops", default="plain step|scaler+unscale_+clip", help="AMP loops, '|'-separated")
    ap.add_argument("--iters", type=int, default=200, help="iterations a round")
    ap.add_argument("--rounds", type=int, default=5, help="interleaved rounds (median)")
    ap.add_argument("--variant", default="", choices=("",) + tuple(VARIANTS),
                    help="also this shardamp variant, a third side of the rounds")
    args = ap.parse_args()
    device = torch.device(args.device)
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", init_method=f"file://{tmp}/pg",
                                rank=0, world_size=1)
        try:
            run(args, device)
        finally:
            dist.destroy_process_group()


def run(args: argparse.Namespace, device: torch.device) -> None:
    spec = model_specs(device, device.type != "cuda")[args.model]
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"== host_phases on {name}, torch {torch.__version__}, {time.strftime('%Y-%m-%d')}: {args.model}")
    for loop in args.loops.split("|"):
        fns = {impl: make_iteration(impl, build_model(spec, device), spec["batch"], spec["loss"], loop, device,
                                    spec["amp"]) for impl in ("torch", "shardamp")}
        if args.variant:
            fns[args.variant] = make_iteration("shardamp", build_model(spec, device), spec["batch"], spec["loss"],
                                               loop, device, spec["amp"], variant=args.variant)
        for fn in fns.values():
            for _ in range(30):
                fn()
        got = phases(fns, device, args.iters, args.rounds)
        print(f"{loop}: host us per phase (median of {args.rounds} interleaved rounds of {args.iters} iterations)")
        for ph in got["torch"]:
            t, s = got["torch"][ph], got["shardamp"][ph]
            line = f"  {ph:10s} torch {t:8.1f}  shardamp {s:8.1f}  difference {s - t:+8.1f}"
            if args.variant:
                v = got[args.variant][ph]
                line += f"  |  {args.variant} {v:8.1f}  variant - shardamp {v - s:+8.1f}"
            print(line)
        acc: Dict[str, List[float]] = {}
        saved = _wrap_all(acc)
        try:
            one = fns["shardamp"]
            for _ in range(10):
                one()
            acc.clear()
            gc.collect()
            gc.disable()
            t0 = time.perf_counter()
            for _ in range(args.iters):
                one()
            total = time.perf_counter() - t0
        finally:
            gc.enable()
            for owner, attr, fn in saved:
                setattr(owner, attr, fn)
        print(f"  shardamp's functions, wrapped ({total / args.iters * 1e6:.0f} us an iteration with the wrappers): "
              "inclusive us an iteration (calls an iteration)")
        for label, (secs, calls) in sorted(acc.items(), key=lambda kv: -kv[1][0]):
            print(f"    {label:36s} {secs / args.iters * 1e6:8.1f}  ({calls / args.iters:.1f})")


if __name__ == "__main__":
    main()
