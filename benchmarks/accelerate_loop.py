"""accelerate's documented loop on the examples' MLP (bf16), its default route (``Accelerator`` +
``AdamW(fused=True)``) against its shardamp route (``ShardampAccelerator`` +
``DistributedFusedAdam``), taken apart: why bench_frameworks.py's rows can differ from
bench_host.py's.

Per route, ``--builds`` fresh models, optimizers and accelerators, the routes taking turns (AB BA
...), each timed over ``--iters`` iterations (20 untimed first) in three loops over the same
batches, already on the device:

* ``free``: no sync inside (the host runs ahead of the GPU, as in bench_host.py), with the host
  time of each phase (forward, backward, clip, step, zero_grad; medians over the iterations);
* ``synced``: ``torch.cuda.synchronize()`` at each iteration's start, as a blocking batch copy
  does (the host waits for the last iteration's kernels);
* ``loader``: batches from accelerate's prepared data loader (its default blocking copy);

then each route's GPU work per iteration (``torch.profiler``, device self time over 20
iterations of the last build, the largest kernels listed). Milliseconds per iteration, each
build's and their median.

    python benchmarks/accelerate_loop.py --device cuda
"""
from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable, Dict, List

import torch
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parents[1] / "examples"))
import framework_models  # noqa: E402
import framework_routes  # noqa: E402

PHASES = ("forward", "backward", "clip", "step", "zero_grad")


def build(route: str, device: torch.device, batches: int) -> Any:
    """A fresh accelerator, model, optimizer and ``batches`` batches on the device."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState

    from shardamp.integrations.accelerate import ShardampAccelerator

    AcceleratorState._reset_state(True)  # accelerate keeps one configuration per process
    GradientState._reset_state()
    cls = ShardampAccelerator if route == "shardamp" else Accelerator
    acc = cls(mixed_precision="bf16", cpu=device.type != "cuda")
    work = framework_models.workload("mlp", small=device.type != "cuda")
    model = work.model(acc.device)
    opt = framework_routes.make_optimizer(route, model, device.type == "cuda")
    loader = DataLoader(work.dataset(batches), batch_size=work.batch, shuffle=False)
    model, opt, loader = acc.prepare(model, opt, loader)
    return acc, model, opt, loader, [b for _, b in zip(range(batches), loader)]


def loop(acc: Any, model: Any, opt: Any, batches: Any, synced: bool = False,
         phases: Dict[str, List[float]] | None = None) -> None:
    """accelerate's documented loop: backward, clip_grad_norm_(1.0), step, zero_grad."""
    pc = time.perf_counter
    for batch in batches:
        if synced:
            torch.cuda.synchronize()
        t0 = pc()
        loss = model(**batch)["loss"]
        t1 = pc()
        acc.backward(loss)
        t2 = pc()
        acc.clip_grad_norm_(model.parameters(), framework_routes.MAX_GRAD_NORM)
        t3 = pc()
        opt.step()
        t4 = pc()
        opt.zero_grad()
        t5 = pc()
        if phases is not None:
            for name, a, b in zip(PHASES, (t0, t1, t2, t3, t4), (t1, t2, t3, t4, t5)):
                phases.setdefault(name, []).append((b - a) * 1e6)


def timed(fn: Callable[[], None], device: torch.device, iters: int) -> float:
    """Milliseconds per iteration of ``fn`` (``iters`` of them), the collector off inside."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    gc.collect()
    gc.disable()
    t0 = time.perf_counter()
    try:
        fn()
        sync()
    finally:
        gc.enable()
    return (time.perf_counter() - t0) * 1e3 / iters


def gpu_work(acc: Any, model: Any, opt: Any, batches: Any) -> Dict[str, Any]:
    """Device self time per iteration over ``batches`` (profiled), and the largest kernels."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        loop(acc, model, opt, batches)
        torch.cuda.synchronize()
    n = len(batches)
    events = list(prof.key_averages())
    top = sorted(events, key=lambda e: -e.self_device_time_total)[:12]
    return {"us": sum(e.self_device_time_total for e in events) / n,
            "kernels": [(e.key[:64], e.count / n, e.self_device_time_total / n) for e in top]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--builds", type=int, default=4, help="fresh builds per route, the routes taking turns")
    p.add_argument("--iters", type=int, default=150, help="timed iterations per loop")
    args = p.parse_args()
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    loops = ("free", "synced", "loader") if cuda else ("free", "loader")
    out: Dict[str, Dict[str, Any]] = {}
    for rep in range(args.builds):
        for route in (("default", "shardamp") if rep % 2 == 0 else ("shardamp", "default")):
            acc, model, opt, loader, batches = build(route, device, 20 + args.iters)
            loop(acc, model, opt, batches[:20])
            timed_batches = batches[20:]
            r = out.setdefault(route, {"phases": {}})
            phases: Dict[str, List[float]] = {}
            r.setdefault("free", []).append(
                timed(lambda: loop(acc, model, opt, timed_batches, phases=phases), device, args.iters))
            for name in PHASES:
                r["phases"].setdefault(name, []).append(statistics.median(phases[name]))
            if cuda:
                r.setdefault("synced", []).append(
                    timed(lambda: loop(acc, model, opt, timed_batches, synced=True), device, args.iters))
            r.setdefault("loader", []).append(
                timed(lambda: loop(acc, model, opt, (b for _, b in zip(range(args.iters), loader))), device,
                      args.iters))
            if cuda and rep >= args.builds - 2:  # the last build of each route
                r["gpu"] = gpu_work(acc, model, opt, timed_batches[:20])
            del acc, model, opt, loader, batches, timed_batches
            gc.collect()
            if cuda:
                torch.cuda.empty_cache()
    print(f"accelerate's loop, the examples' MLP in bf16, on {torch.cuda.get_device_name(device) if cuda else 'cpu'}, "
          f"torch {torch.__version__}: {args.builds} builds a route taking turns, {args.iters} iterations a loop")
    for route, r in out.items():
        for name in loops:
            ms = r[name]
            print(f"{route:9s} {name:7s} ms/iter {[round(x, 3) for x in ms]} median {statistics.median(ms):.3f}")
        for name in PHASES:
            print(f"{route:9s}   {name:10s} host us (median of each build) {[round(x, 1) for x in r['phases'][name]]}")
    for route, r in out.items():
        if "gpu" in r:
            print(f"\n{route}: GPU work {r['gpu']['us']:.1f} us an iteration (device self time)")
            for key, count, us in r["gpu"]["kernels"]:
                print(f"    {us:8.1f} us  {count:4.1f} x  {key}")


if __name__ == "__main__":
    main()
