"""Where one training iteration spends host time, phase by phase (used by bench_host --profile):
the CUDA runtime calls each phase makes (launches, copies, memsets, events, syncs) with the Python
line that made each copy, memset or sync, the Python functions with the most own time, and the
GPU's idle gaps with the host phase that left it idle.

A phase is the span between two of the iteration's marks (host_iteration.PHASES): zero_grad,
forward, backward, unscale_, clip, step, update. On CUDA autograd runs backward's ops on a device
thread of its own while the main thread waits: runtime calls are given to the phase whose span
holds their start time, whichever thread made them (so a call of another thread, the release
thread's frees or a watchdog's event query, counts in the phase it happened in). cProfile sees
the main thread only, not the grad hooks' Python callbacks on the device thread
(``benchmarks/profile_backward.py`` times those). torch's sync debug mode is process-wide, and
autograd replays the warnings its device threads raised on the caller's thread after backward:
a sync inside backward is reported at the ``backward()`` call's line.
"""
from __future__ import annotations

import bisect
import collections
import cProfile
import gc
import io
import pstats
import time
import warnings
from typing import Callable, Dict, List, Tuple

import torch

from host_iteration import PHASES, sync

_NEXT = dict(zip(PHASES[1:], PHASES[2:] + ("",)))  # mark(p) ends phase p and begins the next one
# runtime calls worth a Python stack: each one costs more host time than a launch, or waits
_STACKED = ("Memcpy", "Memset", "Synchronize", "Malloc", "HostAlloc", "Free")


def _phased(one: Callable[..., None]) -> Callable[[], None]:
    """``one`` with each phase inside a profiler range named ``phase:<name>``."""
    def run() -> None:
        current = [torch.autograd.profiler.record_function("phase:zero_grad")]
        current[0].__enter__()

        def mark(phase: str) -> None:
            current[0].__exit__(None, None, None)
            current[0] = None
            nxt = _NEXT.get(phase, "")
            if nxt:
                rng = torch.autograd.profiler.record_function(f"phase:{nxt}")
                rng.__enter__()
                current[0] = rng  # only once entered: the finally below exits what was entered

        try:
            one(mark)
        finally:
            if current[0] is not None:  # one() raised inside a phase
                current[0].__exit__(None, None, None)
    return run


def _phase_finder(events) -> Callable[[float], str]:
    """start time (us) -> the phase whose ``phase:*`` range holds it ('?' outside all)."""
    # the CPU ranges only: Kineto also puts each range on the GPU timeline, later and per stream
    spans = sorted((e.time_range.start, e.time_range.end, e.name[6:]) for e in events
                   if e.name.startswith("phase:") and e.device_type == torch.autograd.DeviceType.CPU)
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:])), "phase ranges overlap"
    starts = [sp[0] for sp in spans]

    def find(t: float) -> str:
        k = bisect.bisect_right(starts, t) - 1
        return spans[k][2] if k >= 0 and t <= spans[k][1] else "?"
    return find


def _stack_of(evt) -> str:
    while evt is not None:
        frames = [f for f in (evt.stack or []) if "torch/" not in f or "site-packages/torch/optim" in f]
        if frames:
            return " <- ".join(frames[:3])
        evt = evt.cpu_parent
    return "(no Python stack)"


def runtime_calls(one: Callable[..., None], device: torch.device, iters: int = 3) -> List[str]:
    """Per phase, per iteration: each CUDA runtime call's count and host microseconds; the
    Python lines behind the copies, memsets, syncs and allocations."""
    from torch.profiler import ProfilerActivity, profile

    if device.type != "cuda":
        return ["runtime calls: not measured off CUDA"]
    run = _phased(one)
    run()
    sync(device)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], with_stack=True) as prof:
        for _ in range(iters):
            run()
        sync(device)
    count: Dict[tuple, int] = collections.Counter()
    spent: Dict[tuple, float] = collections.Counter()
    where: Dict[tuple, int] = collections.Counter()
    events = prof.events()
    phase_at = _phase_finder(events)
    for evt in events:
        name = evt.name
        if not (name.startswith("cuda") or name.startswith("cu")) or evt.device_type != torch.autograd.DeviceType.CPU:
            continue
        phase = phase_at(evt.time_range.start)
        count[(phase, name)] += 1
        spent[(phase, name)] += evt.cpu_time_total
        if any(s in name for s in _STACKED):
            where[(phase, name, _stack_of(evt))] += 1
    lines = []
    for phase in PHASES[1:] + ("?",):
        calls = sorted((k[1] for k in count if k[0] == phase), key=lambda n: -spent[(phase, n)])
        if calls:
            lines.append(f"  {phase}: " + ", ".join(
                f"{n} {count[(phase, n)] / iters:g}x {spent[(phase, n)] / iters:.0f}us" for n in calls))
    for (phase, name, stack), n in sorted(where.items()):
        lines.append(f"    {phase} {name} {n / iters:g}x: {stack}")
    return lines


def idle_gaps(intervals: List[tuple], start: float, end: float,
              phase_at: Callable[[float], str]) -> Tuple[float, List[Tuple[float, float, str]]]:
    """The device's busy time and idle gaps in ``[start, end]`` (microseconds).

    ``intervals``: ``(begin, end)`` of everything the device ran (kernels, copies, memsets), in
    any order, overlapping where streams ran at once. Returns the busy time (their union) and
    each gap ``(length, begin, phase)``, ``phase`` being what the host was running when the
    device fell idle (``phase_at(begin)``): the host phase that kept it waiting."""
    busy = 0.0
    gaps: List[Tuple[float, float, str]] = []
    cur_begin, cur_end = None, start
    for b, e in sorted(intervals):
        b, e = max(b, start), min(e, end)
        if e <= b:
            continue
        if cur_begin is None or b > cur_end:
            if cur_begin is not None:
                busy += cur_end - cur_begin
            if b > cur_end:
                gaps.append((b - cur_end, cur_end, phase_at(cur_end)))
            cur_begin, cur_end = b, e
        else:
            cur_end = max(cur_end, e)
    if cur_begin is not None:
        busy += cur_end - cur_begin
    if end > cur_end:
        gaps.append((end - cur_end, cur_end, phase_at(cur_end)))
    return busy, gaps


def gpu_timeline(one: Callable[..., None], device: torch.device, iters: int = 10, top: int = 5) -> List[str]:
    """Over ``iters`` back-to-back iterations (synchronized at the ends only, as the timed loops
    run): the wall time, the GPU's busy time (the union of its kernels, copies and memsets over
    all streams) and its idle time per iteration, the idle time by the host phase that was running
    when the GPU fell idle, and the longest gaps. A loop whose iteration is longer than its host
    time with little GPU idle is GPU-bound; idle time under one phase is the host keeping the
    GPU waiting there (or a wait on the host, which :func:`runtime_calls` would show)."""
    from torch.profiler import ProfilerActivity, profile

    if device.type != "cuda":
        return ["GPU timeline: not measured off CUDA"]
    run = _phased(one)
    run()
    sync(device)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            run()
        sync(device)
    events = prof.events()
    cpu, gpu_type = torch.autograd.DeviceType.CPU, torch.autograd.DeviceType.CUDA
    phases = [e for e in events if e.name.startswith("phase:") and e.device_type == cpu]
    start, host_end = min(e.time_range.start for e in phases), max(e.time_range.end for e in phases)
    device_work = [(e.time_range.start, e.time_range.end) for e in events
                   if e.device_type == gpu_type and not getattr(e, "is_user_annotation", False)
                   and not e.name.startswith("phase:")]
    end = max([host_end] + [w[1] for w in device_work])
    busy, gaps = idle_gaps(device_work, start, end, _phase_finder(events))
    by_phase: Dict[str, float] = collections.Counter()
    for length, _begin, phase in gaps:
        by_phase[phase] += length
    lines = [f"  per iteration: wall {(end - start) / iters:.0f}us, GPU busy {busy / iters:.0f}us, "
             f"idle {(end - start - busy) / iters:.0f}us in {len(gaps) / iters:.1f} gaps"]
    lines.append("  idle by host phase: " + ", ".join(
        f"{p} {v / iters:.0f}us" for p, v in sorted(by_phase.items(), key=lambda kv: -kv[1])))
    lines += [f"    gap {length:.0f}us at +{begin - start:.0f}us, host in {phase}"
              for length, begin, phase in sorted(gaps, reverse=True)[:top]]
    return lines


def host_waits(one: Callable[..., None], device: torch.device, iters: int = 30) -> List[str]:
    """How often ``one()`` makes the host wait for the GPU through torch's Python API
    (``torch.cuda.Event.synchronize``, ``torch.cuda.Stream.synchronize``,
    ``torch.cuda.synchronize``), counted over ``iters`` iterations run at full speed, with no
    profiler slowing the host (under one the GPU always keeps up, so a wait that happens only
    when the host runs ahead never shows). Such waits are legal and invisible to torch's sync
    debug mode: e.g. the deferred checks wait for the last step's flags if its copy has not
    finished."""
    if device.type != "cuda":
        return ["host waits: not measured off CUDA"]
    targets = [(torch.cuda.Event, "synchronize"), (torch.cuda.Stream, "synchronize"), (torch.cuda, "synchronize")]
    counts: Dict[str, int] = collections.Counter()
    saved = [getattr(owner, name) for owner, name in targets]

    def counting(label: str, fn: Callable[..., None]) -> Callable[..., None]:
        def wrapper(*args, **kwargs):
            counts[label] += 1
            return fn(*args, **kwargs)
        return wrapper

    one()
    sync(device)
    walls: List[float] = []
    start = time.perf_counter()
    try:
        for (owner, name), fn in zip(targets, saved):
            setattr(owner, name, counting(f"{getattr(owner, '__name__', owner)}.{name}", fn))
        for _ in range(iters):
            t0 = time.perf_counter()
            one()
            walls.append((time.perf_counter() - t0) * 1e6)
    finally:
        for (owner, name), fn in zip(targets, saved):
            setattr(owner, name, fn)
    sync(device)
    drained = (time.perf_counter() - start) * 1e6 / iters
    walls.sort()
    # the host's time per call at full speed: a spread (p90, max far above the median) is a wait or
    # a periodic cost that the pieces' medians leave out
    return ["  per iteration: " + (", ".join(f"{k} {v / iters:g}x" for k, v in sorted(counts.items())) or "none"),
            f"  host time per call: median {walls[len(walls) // 2]:.0f}us, p90 {walls[int(len(walls) * 0.9)]:.0f}us, "
            f"max {walls[-1]:.0f}us, mean {sum(walls) / len(walls):.0f}us; with the GPU drained at the end "
            f"{drained:.0f}us"]


def python_hotspots(one: Callable[..., None], iters: int = 20, top: int = 20,
                    phases: tuple = ("backward", "unscale_", "clip", "step", "update")) -> List[str]:
    """cProfile over ``phases`` of ``iters`` iterations (the main thread only: on CUDA the grad
    hooks' callbacks run on autograd's device thread), the cyclic gc off: the functions with the
    most own time, in microseconds per iteration."""
    prof = cProfile.Profile()
    first = PHASES[PHASES.index(phases[0]) - 1]  # the mark that ends the phase before them

    def mark(phase: str) -> None:
        if phase == first:
            prof.enable()
        elif phase == phases[-1]:
            prof.disable()

    was = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        for _ in range(iters):
            one(mark)
    finally:
        prof.disable()
        if was:
            gc.enable()
    stream = io.StringIO()
    stats = pstats.Stats(prof, stream=stream)
    rows = sorted(stats.stats.items(), key=lambda kv: -kv[1][2])[:top]  # by own (total) time
    lines = []
    for (file, line, func), (_cc, ncalls, tottime, cumtime, _callers) in rows:
        short = "/".join(file.split("/")[-2:])
        lines.append(f"    {tottime / iters * 1e6:7.0f}us own {cumtime / iters * 1e6:7.0f}us cum "
                     f"{ncalls / iters:5.1f}x  {short}:{line}({func})")
    return lines


def host_syncs(one: Callable[..., None], device: torch.device, iters: int = 2) -> List[str]:
    """Where ``one()`` makes the host wait on the GPU through torch (an ``.item()``, a blocking
    copy, a stream synchronize): torch's sync debug mode, one ``file:line: message`` per distinct
    place, per iteration (a sync inside backward at the ``backward()`` call's line: see the module
    docstring). Not seen here: a wait inside an extension's own CUDA calls (the profiler's
    cudaStreamSynchronize / cudaEventSynchronize rows in :func:`runtime_calls` show those)."""
    if device.type != "cuda":
        return ["not measured off CUDA"]
    one()
    sync(device)
    seen: Dict[str, int] = {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        mode = torch.cuda.get_sync_debug_mode()
        torch.cuda.set_sync_debug_mode("warn")
        try:
            for _ in range(iters):
                one()
        finally:
            torch.cuda.set_sync_debug_mode(mode)
    sync(device)
    for w in caught:
        if "prototype feature" in str(w.message):  # torch's notice about the mode itself
            continue
        key = f"{w.filename}:{w.lineno}: {str(w.message).splitlines()[0][:120]}"
        seen[key] = seen.get(key, 0) + 1
    return [f"{n / iters:g}x per iteration  {k}" for k, n in seen.items()]
