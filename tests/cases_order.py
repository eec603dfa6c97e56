"""Collectives that do not line up (a skipped step, an extra backward, an extra all-reduce on one
rank), bounded on the host (gloo) and watched by collective_watchdog.py (the CUDA path, forced on
gloo), plus the helpers every agreement case uses. Imported by cases_agreement.py, whose spawned
groups (test_agreement.py) run these cases with the others (and those of cases_two_optimizers.py).
"""
from __future__ import annotations

import contextlib
import datetime
import os
import time

import torch

from shardamp.optim import config
import torch.distributed as dist

from parity import MLP, batches
from shardamp.optim import DistributedFusedAdam

TINY = 0.0004


def _raised(fn):
    try:
        fn()
    except (ValueError, RuntimeError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return "NO ERROR"


def _backward(model, rank, world, step=0):
    x, y = batches(step, world)[rank]
    ((model(x) - y) ** 2).mean().backward()


def _params(model):
    return [p.detach().clone() for p in model.parameters()]


def _unchanged(model, before):
    return all(torch.equal(a, b) for a, b in zip(model.parameters(), before))


# ---------------------------------------------------------------- collectives that do not line up
ORDER_BOUND = 3.0  # SHARDAMP_COLLECTIVE_TIMEOUT of these cases (seconds)


@contextlib.contextmanager
def _bounded_group(world, bound=ORDER_BOUND, group_timeout=60.0, watchdog=False):
    """A fresh group of every rank (a case that desynchronises it leaves it unusable; its timeout
    ``group_timeout`` s) with SHARDAMP_COLLECTIVE_TIMEOUT=``bound`` (None: unset) and, with
    ``watchdog``, SHARDAMP_COLLECTIVE_WATCHDOG=force, the path of CUDA params (no bounded host
    wait; the monitor thread of collective_watchdog.py ends the wait); both unset after it."""
    group = dist.new_group(list(range(world)), use_local_synchronization=True,
                           timeout=datetime.timedelta(seconds=group_timeout))
    if bound is not None:
        os.environ["SHARDAMP_COLLECTIVE_TIMEOUT"] = str(bound)
    if watchdog:
        os.environ["SHARDAMP_COLLECTIVE_WATCHDOG"] = "force"
    config.reload()  # settings are read once per process
    try:
        yield group
    finally:
        os.environ.pop("SHARDAMP_COLLECTIVE_TIMEOUT", None)
        os.environ.pop("SHARDAMP_COLLECTIVE_WATCHDOG", None)
        config.reload()  # settings are read once per process


def _order_case(rank, world, misstep, steps=4, bound=ORDER_BOUND, group_timeout=60.0, watchdog=False):
    """Train on a fresh group (``_bounded_group``: ``bound``, ``group_timeout``, ``watchdog``);
    at step index 2 ``misstep(opt, model, rank, world)`` may replace rank 1's iteration (returns
    True if it did). Returns what each rank raised, at which iteration, and how long after that
    iteration began; with ``watchdog`` also whether a later optimizer call raises the same error
    and which groups were aborted."""
    with _bounded_group(world, bound, group_timeout, watchdog) as group:
        torch.manual_seed(0)
        model = MLP()
        opt = DistributedFusedAdam(model.parameters(), lr=1e-2, bucket_cap_mb=TINY, process_group=group)
        assert (opt._comm.watchdog is not None) == watchdog and opt._comm.bounded != watchdog
        t0 = time.monotonic()
        for step in range(steps):
            if step == 2:
                t0 = time.monotonic()
            try:
                if not (step == 2 and misstep(opt, model, rank, world)):
                    _backward(model, rank, world, step=step)
                    opt.step()
                    opt.zero_grad()
            except (RuntimeError, ValueError) as exc:
                out = {"error": f"{type(exc).__name__}: {exc}", "at": step, "seconds": time.monotonic() - t0}
                if watchdog:
                    out["again"] = _raised(lambda: _backward(model, rank, world, step=step + 1))
                    out["aborted"] = len(opt._comm.watchdog.aborted)
                return out
        return {"error": "NO ERROR", "at": None, "seconds": time.monotonic() - t0}


def _skip_step(opt, model, r, w):  # the usual way to skip: drop the grads instead of stepping
    if r != 1:
        return False
    _backward(model, r, w, step=2)
    opt.zero_grad()
    return True


def _skip_step_keep_grads(opt, model, r, w):
    if r != 1:
        return False
    _backward(model, r, w, step=2)
    return True


def _extra_backward(opt, model, r, w):
    if r != 1:
        return False
    _backward(model, r, w, step=2)
    _backward(model, r, w, step=2)
    opt.step()
    opt.zero_grad()
    return True


def _second_norm_on_one_rank(opt, model, r, w):
    _backward(model, r, w, step=2)
    opt.grad_norm()
    if r == 1:
        opt.grad_norm(1.0)  # one more (tiny) all-reduce on this rank only
    opt.step()
    opt.zero_grad()
    return True


def case_order_skipped_step(rank, world, **kw):
    return _order_case(rank, world, _skip_step)


def case_order_skipped_step_group_timeout(rank, world, **kw):
    """Without SHARDAMP_COLLECTIVE_TIMEOUT the process group's own timeout bounds the waits, with
    the same error."""
    return _order_case(rank, world, _skip_step, bound=None, group_timeout=ORDER_BOUND)


def case_order_skipped_step_kept_grads(rank, world, **kw):
    return _order_case(rank, world, _skip_step_keep_grads)


def case_order_extra_backward(rank, world, **kw):
    return _order_case(rank, world, _extra_backward)


def case_order_second_norm_type_on_one_rank(rank, world, **kw):
    return _order_case(rank, world, _second_norm_on_one_rank)


# the same with the watchdog (the path of CUDA params, where no wait is bounded on the host)
def case_watched_skipped_step(rank, world, **kw):
    return _order_case(rank, world, _skip_step, watchdog=True)


def case_watched_skipped_step_group_timeout(rank, world, **kw):
    """Unset, the bound is half the group's timeout (ORDER_BOUND here)."""
    return _order_case(rank, world, _skip_step, bound=None, group_timeout=2 * ORDER_BOUND, watchdog=True)


def case_watched_skipped_step_kept_grads(rank, world, **kw):
    return _order_case(rank, world, _skip_step_keep_grads, watchdog=True)


def case_watched_extra_backward(rank, world, **kw):
    return _order_case(rank, world, _extra_backward, watchdog=True)


def case_watched_second_norm_type_on_one_rank(rank, world, **kw):
    return _order_case(rank, world, _second_norm_on_one_rank, watchdog=True)


def case_order_clip_on_one_rank(rank, world, **kw):
    """Clipping on some ranks only would update their shards clipped and the others' not."""
    def misstep(opt, model, r, w):
        _backward(model, r, w, step=2)
        seen["model"], seen["before"] = model, _params(model)
        if r == 1:
            opt.clip_grad_norm(1e-3)
        opt.step()
        return True
    seen = {}
    out = _order_case(rank, world, misstep)
    out["untouched"] = _unchanged(seen["model"], seen["before"])
    return out


def case_order_clip_after_stats_on_one_rank(rank, world, **kw):
    """A clip after the stats (after grad_norm or unscale_) cannot be agreed on before its step:
    it is caught at the next step, on every rank."""
    def misstep(opt, model, r, w):
        _backward(model, r, w, step=2)
        opt.grad_norm()
        if r == 1:
            opt.clip_grad_norm(1e-3)
        opt.step()
        opt.zero_grad()
        return True
    return _order_case(rank, world, misstep)


def case_order_grad_norm_logged_on_one_rank(rank, world, **kw):
    """Control: reading grad_norm() on one rank only (logging) before step is fine."""
    def misstep(opt, model, r, w):
        _backward(model, r, w, step=2)
        if r == 0:
            opt.grad_norm()
        opt.step()
        opt.zero_grad()
        return True
    return _order_case(rank, world, misstep)



def case_order_grad_norm_logged_then_clip_everywhere(rank, world, **kw):
    """Control: rank 0 logs grad_norm() before clipping, the others clip at once. Their step's
    stats start from different calls, which is fine: every rank clips alike."""
    seen = {}

    def misstep(opt, model, r, w):
        seen["model"] = model
        _backward(model, r, w, step=2)
        if r == 0:
            opt.grad_norm()
        opt.clip_grad_norm(1e-3)
        opt.step()
        opt.zero_grad()
        return True
    out = _order_case(rank, world, misstep)
    out["params"] = [p.detach().clone() for p in seen["model"].parameters()]
    return out
