"""Which landing path each framework's shardamp route takes, per optimizer step: a count of the
grad sync's Python entry points (the native landing plan calls none of them inside a backward).

At one process the grad hook lands every complete bucket itself under a plan set at
``zero_grad`` (sync/merged_landings.py); the backward's end then adopts them in one
``quiet_end``. A route that leaves the plan shows Python events (``on_event``, by kind), Python
landings (``_flush``), an ``end_of_backward`` and the entry point that took the plan back
(``take`` with the calls that led to it), each with the thread it ran on (on CUDA the backward's
end runs on the autograd device thread). The counts are per step over the run (warm-up
included); no timing.

``--bucket-cap-mb`` sets the optimizers' bucket size where the route leaves the default (the
tiny MLP of ``--small`` then spans several buckets as the full one's 33.6M params span two: with
the frameworks' decay groups some complete ahead of their launch turn).

    python benchmarks/framework_paths.py --device cuda
    python benchmarks/framework_paths.py --device cpu --small --bucket-cap-mb 0.002 --frameworks lightning
"""
from __future__ import annotations

import argparse
import collections
import functools
import sys
import threading
import traceback
from pathlib import Path
from typing import Any, Callable, Counter, Dict, Optional

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import framework_models  # noqa: E402
import framework_routes  # noqa: E402
from shardamp.optim import DistributedFusedAdam  # noqa: E402
from shardamp.optim.sync import grad_stager, grad_sync, merged_landings  # noqa: E402

GRAD_SYNC = ("prearm", "on_grad", "quiet_end", "end_of_backward", "_flush", "_finish_round", "sync")  # + on_event
EVENTS = {grad_stager.NONE: "none", grad_stager.SLOW: "slow", grad_stager.FLUSH: "flush",
          grad_stager.COMPLETE: "complete"}


def _thread() -> str:
    return "main" if threading.current_thread() is threading.main_thread() else "other thread"


def _counted(counts: Counter, owner: type, name: str, label: Callable[..., str]) -> Callable[[], None]:
    """Wrap ``owner.name`` to count its calls under ``label(self, *args)``; returns the undo."""
    real = getattr(owner, name)

    @functools.wraps(real)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        counts[f"{label(self, *args)} [{_thread()}]"] += 1
        return real(self, *args, **kwargs)

    setattr(owner, name, wrapper)
    return lambda: setattr(owner, name, real)


def _took_back(self: Any) -> str:
    if not self.planned:
        return "MergedLandings.take (no plan)"
    callers = [f.name for f in traceback.extract_stack(limit=7)[:-2]]
    return "MergedLandings.take of a plan, via " + " < ".join(reversed(callers))


def _bucket_cap(mb: float) -> Callable[[], None]:
    """Build every DistributedFusedAdam (the routes' subclasses too) with ``bucket_cap_mb=mb``
    unless its caller names one; returns the undo."""
    real = DistributedFusedAdam.__init__

    @functools.wraps(real)
    def init(self: Any, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("bucket_cap_mb", mb)
        real(self, *args, **kwargs)

    DistributedFusedAdam.__init__ = init  # type: ignore[method-assign]
    return lambda: setattr(DistributedFusedAdam, "__init__", real)


def count(framework: str, setting: framework_routes.Setting, precision: str, small: bool,
          bucket_cap_mb: Optional[float] = None) -> Dict[str, float]:
    """One shardamp run of ``framework`` on the MLP: each entry point's calls per optimizer step."""
    counts: Counter = collections.Counter()
    undo = [_counted(counts, grad_sync.GradSync, name, lambda self, *a, n=name: f"GradSync.{n}") for name in GRAD_SYNC]
    undo.append(_counted(counts, grad_sync.GradSync, "on_event",
                         lambda self, event, arg: f"GradSync.on_event {EVENTS.get(event, event)}"))
    undo.append(_counted(counts, merged_landings.MergedLandings, "take", _took_back))
    real_end = merged_landings.MergedLandings.end_quiet

    def end_quiet(self: Any) -> Any:
        out = real_end(self)
        counts[f"MergedLandings.end_quiet: {len(out[1])} landed, complete {out[3]} [{_thread()}]"] += 1
        return out

    merged_landings.MergedLandings.end_quiet = end_quiet
    undo.append(lambda: setattr(merged_landings.MergedLandings, "end_quiet", real_end))
    if bucket_cap_mb is not None:
        undo.append(_bucket_cap(bucket_cap_mb))
    try:
        framework_routes.one_run(framework, "shardamp", framework_models.workload("mlp", small), setting, precision)
    finally:
        for u in undo:
            u()
    return {k: v / setting.steps for k, v in sorted(counts.items())}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--frameworks", default="lightning,accelerate,transformers")
    ap.add_argument("--precision", default="bf16", choices=("bf16", "fp16"))
    ap.add_argument("--steps", type=int, default=20, help="optimizer steps after 5 warm-up ones")
    ap.add_argument("--small", action="store_true", help="the tiny MLP (a CPU smoke run)")
    ap.add_argument("--bucket-cap-mb", type=float, default=None,
                    help="the optimizers' bucket size (default: the routes' own, 100 MB)")
    args = ap.parse_args()
    setting = framework_routes.Setting(torch.device(args.device), args.small, 5, args.steps)
    for framework in args.frameworks.split(","):
        print(f"== {framework} (shardamp route, mlp, {args.precision}, {args.device}): calls per step")
        for key, per_step in count(framework, setting, args.precision, args.small, args.bucket_cap_mb).items():
            print(f"  {per_step:6.2f}  {key}")


if __name__ == "__main__":
    main()
