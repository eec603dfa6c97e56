"""The one way tests run code on several ranks: spawn ``world_size`` CPU processes joined in a
gloo group through a ``file://`` rendezvous in a fresh temp dir (no ports, so no races under
pytest-xdist), run ``fn(rank, world_size, *args)`` on each, and return every rank's result.

Spawning costs seconds on two cores, so a test module runs MANY cases inside one group (see
``run_cases``) and caches the results per world size.
"""
from __future__ import annotations

import datetime
import os
import pickle
import sys
import tempfile
import time
import traceback
from typing import Any, Callable, Dict, List

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _worker(rank: int, world_size: int, init_file: str, out_dir: str, fn: Callable, args: tuple, backend: str,
            pg_timeout: float | None = None) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    if backend == "nccl":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    extra = {} if pg_timeout is None else {"timeout": datetime.timedelta(seconds=pg_timeout)}
    dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank, world_size=world_size, **extra)
    try:
        result: Any = ("ok", fn(rank, world_size, *args))
    except BaseException:  # noqa: BLE001  (shipped back to the test, which re-raises)
        result = ("error", traceback.format_exc())
    with open(os.path.join(out_dir, f"rank{rank}.pkl"), "wb") as f:
        pickle.dump(result, f)
    try:
        dist.destroy_process_group()
    except Exception:
        pass
    # The result is on disk: skip interpreter teardown, where gloo's background threads can
    # abort the process ("terminate called without an active exception") after the fact.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_distributed(
    fn: Callable, world_size: int, *args: Any, timeout: float = 600.0, backend: str = "gloo",
    pg_timeout: float | None = None,
) -> List[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks; return the results by rank.

    A rank that raised makes this raise with that rank's traceback; ranks that hang (mismatched
    collectives) are killed after ``timeout`` seconds. ``pg_timeout`` (seconds) bounds every
    collective of the process group, so a regression fails instead of hanging. ``fn`` must be
    importable (module level).
    """
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "rendezvous")
        ctx = mp.start_processes(
            _worker, args=(world_size, init_file, tmp, fn, args, backend, pg_timeout), nprocs=world_size, join=False,
            start_method="spawn",
        )
        deadline = time.monotonic() + timeout
        while not ctx.join(timeout=1.0):
            if time.monotonic() > deadline:
                for p in ctx.processes:
                    if p.is_alive():
                        p.kill()
                partial = {}
                for rank in range(world_size):
                    path = os.path.join(tmp, f"rank{rank}.pkl")
                    if os.path.exists(path):
                        with open(path, "rb") as f:
                            partial[rank] = pickle.load(f)
                raise AssertionError(f"ranks hung for {timeout:.0f}s (a collective mismatch?); finished: {partial}")
        results = []
        for rank in range(world_size):
            with open(os.path.join(tmp, f"rank{rank}.pkl"), "rb") as f:
                status, value = pickle.load(f)
            if status != "ok":
                raise AssertionError(f"rank {rank} of {world_size} failed:\n{value}")
            results.append(value)
        return results


def run_cases(rank: int, world_size: int, module: str, names: List[str], kwargs: Dict[str, Any] | None = None) -> Dict[str, Any]:
    """Run each named case ``module.name(rank, world_size, **kwargs)``; a failure is recorded,
    not raised, so the test names it. Every rank runs the cases in the same order."""
    import importlib

    mod = importlib.import_module(module)
    out: Dict[str, Any] = {}
    for name in names:
        try:
            out[name] = ("ok", getattr(mod, name)(rank, world_size, **(kwargs or {})))
        except BaseException:  # noqa: BLE001
            out[name] = ("error", traceback.format_exc())
            break  # a case that failed half-way may leave the ranks' collectives out of step
    return out


def case_values(per_rank: List[Dict[str, Any]], case: str) -> List[Any]:
    """Every rank's value for ``case`` from ``run_cases`` results; fails naming the rank whose
    case (or an earlier one) raised."""
    values = []
    for rank, results in enumerate(per_rank):
        if case not in results:
            failed = [name for name, (status, _) in results.items() if status != "ok"]
            raise AssertionError(
                f"rank {rank}: {case} did not run: the group stopped after {failed or 'an earlier case'} "
                "failed (a case that fails half-way may leave the collectives out of step); fix that case first"
            )
        status, value = results[case]
        assert status == "ok", f"rank {rank}: {value}"
        values.append(value)
    return values
