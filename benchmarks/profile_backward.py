"""Where backward's host time goes with DistributedFusedAdam's grad hooks, against plain autograd
(world 1): the median host time of ``loss.backward()`` for both (bench_host.backward_host: DDP too,
taking turns every iteration, and with ``zero_grad`` counted); the part of shardamp's spent in its
Python callbacks (first grad, bucket flushes and launches, the end-of-backward callback; at one
process the end the hook queued, with the begin it caught up), counted
by wrapping them; and torch.profiler tables (CPU) of a few backwards of each, written under
``--out``. The rest of the difference is the native hook and the launches it makes.

    python benchmarks/profile_backward.py --device cuda       # ResNet-50 (torchvision), fp16 autocast
    python benchmarks/profile_backward.py --device cuda --model "mlp bf16"   # the host-bound MLP

``--model``: any of bench_host's model rows (benchmarks/host_models.py), built, batched and
autocast as bench_host does; the default is ResNet-50, or its small stand-in without torchvision
and on the CPU.
"""
from __future__ import annotations

import argparse
import collections
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_host import backward_host  # noqa: E402
from host_iteration import sync  # noqa: E402
from host_models import build_model, model_specs  # noqa: E402

from shardamp.optim import DistributedFusedAdam, kernels  # noqa: E402
from shardamp.optim.step import cycle
from shardamp.optim.sync import grad_sync, merged_landings, reductions


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--out", default="out/profile_backward")
    ap.add_argument("--model", default="", help="one of bench_host's model rows (default: resnet50 / small resnet)")
    args = ap.parse_args()
    device = torch.device(args.device)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    specs = model_specs(device, device.type != "cuda")
    name = args.model or next(n for n in ("resnet50", "small resnet") if n in specs)
    if name not in specs:
        raise SystemExit(f"--model {name!r}: one of {', '.join(specs)}")
    spec = specs[name]
    inputs, target = spec["batch"]()
    amp = spec["amp"]

    spent = collections.Counter()
    calls = collections.Counter()
    order = []  # the names in the order they are printed

    def timed(name, fn):
        if name not in order:
            order.append(name)
        def wrapper(self, *a, **k):
            if not active[0]:
                return fn(self, *a, **k)
            t0 = time.perf_counter()
            try:
                return fn(self, *a, **k)
            finally:
                spent[name] += time.perf_counter() - t0
                calls[name] += 1
        return wrapper

    active = [False]  # counted only inside the breakdown pass's shardamp backwards

    def install() -> None:  # after the timing pass: the medians are taken without wrappers
        grad_sync.GradSync.on_event = timed("callbacks", grad_sync.GradSync.on_event)
        # one process, pre-armed: the end the hook queued (no callback at the first grad), with the
        # begin caught up in it (the first grad's bookkeeping below)
        grad_sync.GradSync.quiet_end = timed("end of backward, queued by the hook (one process)",
                                             grad_sync.GradSync.quiet_end)
        grad_sync.GradSync._begin = timed("  of which the first grad's bookkeeping", grad_sync.GradSync._begin)
        # the quiet end's other pieces (each a few us; after a backward every one runs cold; the
        # adoption and the class switch are counted wherever called, inside the end or not)
        merged_landings.MergedLandings.end_quiet = timed("  of which the stager's end and its landed buckets",
                                                         merged_landings.MergedLandings.end_quiet)
        grad_sync.GradSync._adopt_all = timed("  of which adopting the landed buckets", grad_sync.GradSync._adopt_all)
        grad_sync.GradSync._finish_round = timed("  of which ending the round", grad_sync.GradSync._finish_round)
        cycle.StepCycle.backward_ended = timed("  of which the params' class switch (backward_ended)",
                                               cycle.StepCycle.backward_ended)
        grad_sync.GradSync.on_grad = timed("  of which grads Python stages itself", grad_sync.GradSync.on_grad)
        grad_sync.GradSync._flush = timed("  of which bucket landings (with their allocs)", grad_sync.GradSync._flush)
        grad_sync.GradSync._launch = timed("  of which bucket launches (with their allocs, stats)", grad_sync.GradSync._launch)
        grad_sync.GradSync._writable_full = timed("  of which buffer alloc/zero", grad_sync.GradSync._writable_full)
        grad_sync.GradSync._arm_plan = timed("  of which the landing plan handed to the hook (one process)",
                                             grad_sync.GradSync._arm_plan)
        reductions.Reductions._land_on_side_stream = timed("  of which side stream + stats",
                                                          reductions.Reductions._land_on_side_stream)
        grad_sync.GradSync.end_of_backward = timed("end of backward", grad_sync.GradSync.end_of_backward)

    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", init_method=f"file://{tmp}/pg",
                                rank=0, world_size=1)

        def build() -> torch.nn.Module:
            return build_model(spec, device)

        def forward(m: torch.nn.Module) -> torch.Tensor:
            with torch.autocast(device.type, dtype=amp or torch.float32, enabled=amp is not None):
                return spec["loss"](m(*inputs), target)

        # the medians: bench_host's backward rows (the impls take turns every iteration)
        med = backward_host(build, forward, device, args.iters)
        # for the profiles and the breakdown: one model per side
        models = {"torch": (build(), None)}
        model = build()
        models["shardamp"] = (model, DistributedFusedAdam(model.parameters(), lr=1e-4))
        nparams = len(list(models["torch"][0].parameters()))

        def one(impl: str, record: bool, times):
            m, opt = models[impl]
            if opt is not None:
                opt.zero_grad()
            else:
                m.zero_grad(set_to_none=True)
            loss = forward(m)
            sync(device)
            active[0] = record and opt is not None
            t0 = time.perf_counter()
            loss.backward()
            t1 = time.perf_counter()
            active[0] = False
            sync(device)
            if record:
                times[impl].append((t1 - t0) * 1e6)
            if opt is not None:
                opt.step()

        times = {"torch": [], "shardamp": []}
        for _ in range(3):
            for impl in models:
                one(impl, False, times)
        # the landed grads freed on the release thread (the default) or in land(), taking turns
        native = kernels.native_module(device)
        frees = {True: [], False: []}
        if device.type == "cuda" and native is not None and hasattr(native, "set_async_release"):
            for i in range(2 * args.iters):
                native.set_async_release(i % 2 == 0)
                one("shardamp", True, {"shardamp": frees[i % 2 == 0]})
            native.set_async_release(True)
        from torch.profiler import ProfilerActivity, profile

        for impl in models:  # before the wrappers below, which would add to shardamp's table
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                for _ in range(5):
                    one(impl, False, times)
            (out / f"backward_{impl}.txt").write_text(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=150))
        install()  # the breakdown: shardamp backwards with their callbacks timed
        for _ in range(args.iters):
            one("shardamp", True, times)
        lines = [f"{device} {torch.cuda.get_device_name(device) if device.type == 'cuda' else ''}, torch "
                 f"{torch.__version__}, {name}: {nparams} params, {args.iters} backwards each, "
                 f"{time.strftime('%Y-%m-%d')}",
                 f"backward host: torch {med['torch']:.0f} us, shardamp {med['shardamp']:.0f} us, over torch "
                 f"{med['shardamp'] - med['torch']:+.0f} us ({(med['shardamp'] - med['torch']) / nparams:+.2f} us/param)"]
        lines.append(f"  with zero_grad counted: {(med['shardamp+zero_grad'] - med['torch+zero_grad']) / nparams:+.2f} "
                     f"us/param (DDP's reducer, backward alone: {(med['ddp'] - med['torch']) / nparams:+.2f})")
        if frees[True]:
            on, off = statistics.median(frees[True]), statistics.median(frees[False])
            lines.append(f"  landed grads freed on the release thread: {on:.0f} us, in land(): {off:.0f} us "
                         f"({(off - on) / nparams:+.2f} us/param saved)")
        lines.append(f"  breakdown over {args.iters} more shardamp backwards "
                     f"(median {statistics.median(times['shardamp']):.0f} us with the timing wrappers):")
        for name in (n for n in order if n in spent):
            lines.append(f"  {name}: {spent[name] / args.iters * 1e6:.0f} us per backward in "
                         f"{calls[name] / args.iters:.1f} calls")
        dist.destroy_process_group()
    (out / "summary.txt").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
