"""One training iteration of plain torch or of shardamp in each AMP loop of benchmarks/bench_host.py,
and how that benchmark times and measures them: repeats interleaved, median, peak memory of one
implementation alone.

torch = ``torch.optim.AdamW(fused=True)`` + ``torch.amp.GradScaler`` + ``clip_grad_norm_``;
shardamp = ``DistributedFusedAdam`` + ``ShardedGradScaler`` + ``opt.clip_grad_norm``.
"""
from __future__ import annotations

import gc
import statistics
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from shardamp.optim import DistributedFusedAdam, kernels
from shardamp.scaler import ShardedGradScaler

LOOPS = {  # name -> (scaler, unscale_, clip): torch runs exactly this; shardamp its equivalent
    "scaler+unscale_+clip": (True, True, True),
    "scaler+unscale_": (True, True, False),
    "max_grad_norm in step": (True, True, True),  # shardamp: DistributedFusedAdam(max_grad_norm=1)
    # the same with the transformers Trainer's two groups (weight decay on matrices, none on
    # biases and norms): shardamp adds each group's norm partial to the step's statistics
    "max_grad_norm in step, two groups": (True, True, True),
    "scaler, no unscale_": (True, False, False),
    "plain step": (False, False, False),
}


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ------------------------------------------------------------------------------ one iteration
# shardamp's variants for an A/B inside one row (bench_host --variants): name -> what differs.
# "settings": shardamp.optim.config values in force while the optimizer is built; "release":
# the release thread's switch while each iteration runs (process-wide: set back after the call,
# on the extension itself, ~1 us: config.configure costs tens of us a call, which would bias the
# A/B by a percent of a host-bound iteration); "opt": constructor arguments.
VARIANTS: Dict[str, Dict[str, Any]] = {
    "inline-free": {"release": False},  # landed grads freed inline, no release thread
    "python-hooks": {"settings": {"python_grad_hooks": True}},
    "no-overlap": {"opt": {"overlap_grad_sync": False}},  # grads land at the step, not in backward
    "one-bucket": {"opt": {"bucket_cap_mb": 4096.0}},
}


def has_release_switch(device: torch.device) -> bool:
    """Whether the compiled kernels for ``device`` have the release thread's switch (the
    ``inline-free`` variant needs it)."""
    native = kernels.native_module(device)
    return native is not None and hasattr(native, "set_async_release")


def make_iteration(impl: str, model: torch.nn.Module, batch: Callable, loss_fn: Callable, loop: str,
                   device: torch.device, amp_dtype: Optional[torch.dtype], lr: float = 1e-4,
                   variant: str = ""):
    """Build the optimizer (after the model is final) and return ``one()``: a full iteration.
    ``variant``: one of :data:`VARIANTS` (shardamp only)."""
    from shardamp.optim import config

    spec = VARIANTS[variant] if variant else {}
    use_scaler, unscale, clip = LOOPS[loop]
    use_scaler = use_scaler and amp_dtype is not torch.bfloat16
    in_step = loop.startswith("max_grad_norm in step")
    params = [p for p in model.parameters() if p.requires_grad]
    groups: Any = params
    if loop.endswith("two groups"):
        groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.01},
                  {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    if impl == "torch":
        opt = torch.optim.AdamW(groups, lr=lr, fused=True) if device.type == "cuda" else torch.optim.AdamW(groups, lr=lr)
        scaler = torch.amp.GradScaler(device.type, enabled=use_scaler)
        do_clip = (lambda: torch.nn.utils.clip_grad_norm_(params, 1.0)) if clip else (lambda: None)
    else:
        settings = spec.get("settings", {})
        before = {k: config.explicit().get(k) for k in settings}  # put back as they were, set or not
        config.configure(**settings)
        try:
            opt = DistributedFusedAdam(groups, lr=lr, max_grad_norm=1.0 if in_step else None, **spec.get("opt", {}))
        finally:
            config.configure(**before)
        scaler = ShardedGradScaler(device.type, enabled=use_scaler)
        clip = clip and not in_step
        unscale = unscale and not in_step
        do_clip = (lambda: opt.clip_grad_norm(1.0)) if clip else (lambda: None)
    autocast = torch.autocast(device.type, dtype=amp_dtype or torch.float32, enabled=amp_dtype is not None)

    def one(mark: Callable[[str], None] = lambda _phase: None) -> None:
        opt.zero_grad(set_to_none=True)
        mark("zero_grad")
        inputs, target = batch()
        with autocast:
            loss = loss_fn(model(*inputs), target)
        mark("forward")
        if use_scaler:
            scaler.scale(loss).backward()
            mark("backward")
            if unscale:
                scaler.unscale_(opt)
            mark("unscale_")
            do_clip()
            mark("clip")
            scaler.step(opt)
            mark("step")
            scaler.update()
        else:
            loss.backward()
            mark("backward")
            mark("unscale_")
            do_clip()
            mark("clip")
            opt.step()
            mark("step")
        mark("update")

    if "release" in spec:
        native = kernels.native_module(device)
        if not has_release_switch(device):  # measuring the default under the variant's name would mislead
            raise RuntimeError(f"variant {variant!r}: no compiled kernels with a release thread on {device.type}")
        plain, on = one, config.settings().async_grad_release

        def one(mark: Callable[[str], None] = lambda _phase: None) -> None:  # noqa: F811
            native.set_async_release(spec["release"])
            try:
                plain(mark)
            finally:
                native.set_async_release(on)

    one.opt = opt
    return one


def interleaved(fns: Dict[str, Callable[[], None]], device: torch.device, warmup: int, iters: int,
                repeats: int, samples: Optional[Dict[str, List[float]]] = None,
                gc_objects: Optional[Dict[str, float]] = None,
                iteration_medians: Optional[Dict[str, List[float]]] = None) -> Dict[str, float]:
    """Median ms per call of each fn, repeats interleaved (the order flips every repeat); each
    repeat's ms into ``samples[name]`` if given.

    ``iteration_medians``: each repeat's median call too (ms), into ``iteration_medians[name]``:
    on CUDA the gaps between events recorded after each call (no sync inside the repeat: on a
    host-bound loop the GPU waits for the host, so a gap is a call's host time), on the CPU
    ``perf_counter`` around each call. A repeat's mean moves with the few calls another process
    on the host slowed; its median does not, so the paired ratios of the medians scatter less
    on a shared host. Both sides record the same one event a call.

    Python's cyclic garbage collector is run between repeats and kept off inside them: a
    full collection over a heap of torch, torchvision and transformers objects takes tens of ms,
    lands in whichever repeat triggers it and scattered single repeats by up to 30%. What each
    fn leaves to the collector is not hidden: ``gc_objects[name]`` gets the median number of
    tracked objects per call that it left alive (what triggers collections: allocations less
    deallocations), so a side that would make the collector run more often shows there."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    sync(device)
    times: Dict[str, List[float]] = {k: [] for k in fns}
    left: Dict[str, List[float]] = {k: [] for k in fns}
    names = list(fns)
    was = gc.isenabled()
    try:
        for r in range(repeats):
            for name in (names if r % 2 == 0 else names[::-1]):
                gc.collect()
                gc.disable()
                sync(device)
                before = gc.get_count()[0]
                ms, median = _timed_repeat(fns[name], device, iters, per_call=iteration_medians is not None)
                times[name].append(ms)
                if iteration_medians is not None:
                    iteration_medians.setdefault(name, []).append(median)
                left[name].append((gc.get_count()[0] - before) / iters)
                gc.enable()
    finally:
        if was:
            gc.enable()
        else:
            gc.disable()
    if samples is not None:
        samples.update(times)
    if gc_objects is not None:
        gc_objects.update({k: statistics.median(v) for k, v in left.items()})
    return {k: statistics.median(v) for k, v in times.items()}


def _timed_repeat(fn: Callable[[], None], device: torch.device, iters: int,
                  per_call: bool) -> Tuple[float, Optional[float]]:
    """One repeat of ``iters`` calls of ``fn``: (mean ms a call, from before the first call to
    after the sync that ends the repeat; with ``per_call``, the median ms a call, else None).
    Per call on CUDA: an event before the first call and after each (made before the loop), read
    after that sync; on the CPU ``perf_counter`` around each call."""
    cuda = per_call and device.type == "cuda"
    events = [torch.cuda.Event(enable_timing=True) for _ in range(iters + 1)] if cuda else []
    gaps: List[float] = []
    t0 = time.perf_counter()
    if cuda:
        events[0].record()
    for k in range(iters):
        t1 = time.perf_counter() if per_call else 0.0
        fn()
        if cuda:
            events[k + 1].record()
        elif per_call:
            gaps.append((time.perf_counter() - t1) * 1e3)
    sync(device)
    mean = (time.perf_counter() - t0) * 1e3 / iters
    if cuda:
        gaps = [events[k].elapsed_time(events[k + 1]) for k in range(iters)]
    return mean, statistics.median(gaps) if per_call else None


_T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145,
         2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048,
         2.045, 2.042)


def paired_ratio(a: List[float], b: List[float]) -> tuple:
    """Geometric mean of the paired ratios a[i] / b[i] (repeats that ran back to back) and its
    95% t-interval (on the logs): how sure a row's speed is on a drifting host. It covers the
    scatter between pairs only, not what differs between two builds of the same row (docs/performance.md)."""
    import math

    logs = [math.log(x / y) for x, y in zip(a, b)]
    if not logs:
        return float("nan"), float("nan"), float("nan")
    mean = statistics.fmean(logs)
    if len(logs) < 2:
        return math.exp(mean), float("nan"), float("nan")
    df, z = len(logs) - 1, 1.959964
    # the 0.975 quantile of Student's t: a table to 30 degrees of freedom, then its
    # Cornish-Fisher expansion (within 2e-6 there; no scipy)
    t = _T975[df - 1] if df <= len(_T975) else (
        z + (z**3 + z) / (4 * df) + (5 * z**5 + 16 * z**3 + 3 * z) / (96 * df**2)
        + (3 * z**7 + 19 * z**5 + 17 * z**3 - 15 * z) / (384 * df**3))
    half = t * statistics.stdev(logs) / math.sqrt(len(logs))
    return math.exp(mean), math.exp(mean - half), math.exp(mean + half)


PHASES = ("build", "zero_grad", "forward", "backward", "unscale_", "clip", "step", "update")


def host_pieces(one: Callable[..., None], iters: int) -> Dict[str, float]:
    """Median host microseconds of each piece of ``one()`` (zero_grad, forward, backward,
    unscale_, clip, step, update; perf_counter between its marks, no synchronization: what the
    host spends issuing the work). The cyclic collector runs once before and is off during
    them, as in :func:`interleaved` (a collection walks the whole heap and leaves the next piece
    with cold caches: only one collection, before the first)."""
    times: Dict[str, List[float]] = {}
    was = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        for _ in range(iters):
            last = [time.perf_counter()]

            def mark(phase: str) -> None:
                now = time.perf_counter()
                times.setdefault(phase, []).append((now - last[0]) * 1e6)
                last[0] = now

            one(mark)
    finally:
        if was:
            gc.enable()
    return {k: statistics.median(v) for k, v in times.items()}


def peak_memory(build: Callable[[], Callable[..., None]], device: torch.device,
                iters: int = 3) -> Optional[Dict[str, int]]:
    """Peak bytes allocated while one implementation alone builds and runs ``iters`` iterations:
    ``{"peak": ..., <phase>: ...}``, the phases' peaks (build, then per iteration zero_grad,
    forward, backward, unscale_, clip, step, update) over all iterations, and
    ``"garbage"``: bytes still allocated once the iteration is dropped, before a gc collection
    (reference cycles that keep buffers alive until Python's collector runs).

    ``gc.collect()`` first: garbage of an earlier build (reference cycles of torch's lazy imports,
    DDP) freed by the collector in the middle of this measurement would otherwise lower it by its
    size, e.g. by 4x the param bytes (params, two moments, grads) of the model measured before."""
    if device.type != "cuda":
        return None
    gc.collect()
    sync(device)
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    phases: Dict[str, int] = dict.fromkeys(PHASES, 0)

    def mark(phase: str) -> None:
        sync(device)
        phases[phase] = max(phases[phase], torch.cuda.max_memory_allocated(device) - base)
        torch.cuda.reset_peak_memory_stats(device)

    one = build()
    mark("build")
    for _ in range(iters):
        one(mark)
    sync(device)
    was = gc.isenabled()
    gc.disable()  # what refcounting alone frees
    try:
        del one
        sync(device)
        native = kernels.native_module(device)
        if native is not None and hasattr(native, "drain_released"):
            native.drain_released()  # the last landing's grads, if the release thread still has them
        garbage = torch.cuda.memory_allocated(device) - base
    finally:
        if was:
            gc.enable()
    gc.collect()
    return dict(peak=max(phases.values()), **phases, garbage=max(garbage, 0))

