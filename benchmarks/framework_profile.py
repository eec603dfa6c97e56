"""Where a framework's iteration spends host time, default route against shardamp route (used by
bench_frameworks.py --profile): one more run of each route after a config's timed pairs, its
timed block recorded instead of timed.

Two recordings, each its own run (one would distort the other):

* ``python``: cProfile over the block (the main thread: the framework's loop, the optimizer's
  step, the hooks that run there; not autograd's device thread on CUDA), each function's own and
  cumulative microseconds per iteration; then the functions whose own time differs most between
  the routes.
* ``trace``: torch.profiler (CPU and CUDA) with torch's sync debug mode on: per iteration, each
  CUDA runtime call's count and host microseconds, the GPU's busy and idle time, the places that
  made the host wait through torch (an ``.item()``, a blocking copy), and the aten ops with the
  most own CPU time.

A wait that only happens when the host runs ahead of the GPU does not show under a profiler
(the host is slowed until the GPU keeps up); the timed pairs are the measurement, these only say
where to look.
"""
from __future__ import annotations

import collections
import cProfile
import pstats
import warnings
from typing import Any, Dict, List, Optional, Tuple

import torch

from host_trace import idle_gaps

KINDS = ("python", "trace")
Key = Tuple[str, int, str]  # cProfile's (file, line, function)


def _short(key: Key) -> str:
    file, line, func = key
    return f"{'/'.join(file.split('/')[-2:])}:{line}({func})"


class BlockProfile:
    """One recording (``kind``: ``python`` or ``trace``) of a run's timed block:
    :class:`BlockTimer` calls :meth:`start` at the block's start and :meth:`stop` at its end
    (after the device is synchronized)."""

    def __init__(self, kind: str, device: torch.device) -> None:
        if kind not in KINDS:
            raise ValueError(f"BlockProfile: kind {kind!r}; choose from {', '.join(KINDS)}")
        self.kind, self.device = kind, device
        self.iters = 0
        self.own: Dict[Key, float] = {}  # python: function -> own seconds over the block
        self.lines: List[str] = []
        self._prof: Any = None
        self._caught: Any = None
        self._warnings: Any = None
        self._mode: Optional[int] = None

    def start(self) -> None:
        if self.kind == "python":
            self._prof = cProfile.Profile()
            self._prof.enable()
            return
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.device.type == "cuda" else [])
        self._warnings = warnings.catch_warnings(record=True)
        self._caught = self._warnings.__enter__()
        warnings.simplefilter("always")
        if self.device.type == "cuda":
            self._mode = torch.cuda.get_sync_debug_mode()
            torch.cuda.set_sync_debug_mode("warn")
        self._prof = profile(activities=activities)
        self._prof.__enter__()

    def stop(self, iters: int) -> None:
        self.iters = iters
        if self.kind == "python":
            self._prof.disable()
            self._python()
            return
        self._prof.__exit__(None, None, None)
        if self._mode is not None:
            torch.cuda.set_sync_debug_mode(self._mode)
        self._warnings.__exit__(None, None, None)
        self._trace()

    # ------------------------------------------------------------------ the two summaries
    def _python(self, top: int = 40) -> None:
        stats = pstats.Stats(self._prof).stats
        n = self.iters
        self.own = {key: v[2] for key, v in stats.items()}
        total = sum(self.own.values())
        self.lines = [f"cProfile, main thread, per iteration over {n}: {total / n * 1e6:.0f}us own time in all"]
        for key, (_cc, calls, tottime, cumtime, _callers) in sorted(stats.items(), key=lambda kv: -kv[1][2])[:top]:
            self.lines.append(f"  {tottime / n * 1e6:8.1f}us own {cumtime / n * 1e6:8.1f}us cum "
                              f"{calls / n:6.1f}x  {_short(key)}")

    def _trace(self, top: int = 25) -> None:
        n = self.iters
        events = self._prof.events()
        cpu, cuda = torch.autograd.DeviceType.CPU, torch.autograd.DeviceType.CUDA
        count: Dict[str, int] = collections.Counter()
        spent: Dict[str, float] = collections.Counter()
        ops: Dict[str, float] = collections.Counter()
        ops_n: Dict[str, int] = collections.Counter()
        gpu: List[Tuple[float, float]] = []
        cpu_start, cpu_end = float("inf"), 0.0
        for evt in events:
            if evt.device_type == cpu:
                cpu_start, cpu_end = min(cpu_start, evt.time_range.start), max(cpu_end, evt.time_range.end)
                if evt.name.startswith("cu"):
                    count[evt.name] += 1
                    spent[evt.name] += evt.cpu_time_total
                elif evt.name.startswith("aten::"):
                    ops[evt.name] += evt.self_cpu_time_total
                    ops_n[evt.name] += 1
            elif evt.device_type == cuda:
                gpu.append((evt.time_range.start, evt.time_range.end))
        lines = [f"torch.profiler, per iteration over {n}:"]
        if gpu:
            end = max([cpu_end] + [e for _, e in gpu])
            busy, gaps = idle_gaps(gpu, cpu_start, end, lambda t: "")
            lines.append(f"  wall {(end - cpu_start) / n:.0f}us, GPU busy {busy / n:.0f}us, idle "
                         f"{(end - cpu_start - busy) / n:.0f}us in {len(gaps) / n:.1f} gaps")
        lines.append("  CUDA runtime calls: " + (", ".join(
            f"{k} {count[k] / n:g}x {spent[k] / n:.0f}us" for k in sorted(count, key=lambda k: -spent[k]))
            or "none"))
        syncs: Dict[str, int] = collections.Counter()
        for w in self._caught or []:
            if "prototype feature" in str(w.message):
                continue
            syncs[f"{w.filename}:{w.lineno}: {str(w.message).splitlines()[0][:100]}"] += 1
        lines.append("  host waits through torch (sync debug mode): " + ("none" if not syncs else ""))
        lines += [f"    {c / n:g}x  {k}" for k, c in syncs.items()]
        lines.append("  aten ops by own CPU time:")
        lines += [f"    {ops[k] / n:8.1f}us {ops_n[k] / n:6.1f}x  {k}" for k in sorted(ops, key=lambda k: -ops[k])[:top]]
        self.lines = lines
        self._caught = None


def python_diff(default: BlockProfile, shardamp: BlockProfile, top: int = 30) -> List[str]:
    """The functions whose own time per iteration differs most between the routes' ``python``
    recordings (shardamp minus default), and the totals."""
    a = {k: v / max(default.iters, 1) for k, v in default.own.items()}
    b = {k: v / max(shardamp.iters, 1) for k, v in shardamp.own.items()}
    delta = {k: b.get(k, 0.0) - a.get(k, 0.0) for k in set(a) | set(b)}
    lines = [f"own time per iteration: default {sum(a.values()) * 1e6:.0f}us, shardamp {sum(b.values()) * 1e6:.0f}us, "
             f"shardamp - default {(sum(b.values()) - sum(a.values())) * 1e6:+.0f}us; largest differences:"]
    for key in sorted(delta, key=lambda k: -abs(delta[k]))[:top]:
        lines.append(f"  {delta[key] * 1e6:+8.1f}us  (default {a.get(key, 0) * 1e6:7.1f}, shardamp "
                     f"{b.get(key, 0) * 1e6:7.1f})  {_short(key)}")
    return lines

