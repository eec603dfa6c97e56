"""Ranks whose collectives do not line up: an error on every rank, in bounded time, never gloo's abort.

gloo pairs the k-th collective of a process group on each rank with the k-th on every other,
whatever each one is. When one rank skips ``step()``, runs an extra backward or calls a
collective the others do not, the step's small all-reduce meets a reduce-scatter and gloo aborts
the process on the size mismatch (SIGABRT, "Received data size doesn't match expected size"), or,
where the sizes happen to match, mixes unrelated data. Three rules turn every such mismatch into
one ``RuntimeError`` on every rank that waits:

* Tag spaces (gloo only). The optimizer's collectives go over four process groups spanning the
  same ranks, created once per group and reused by every optimizer over it: the reduce-scatters
  (and the construction and state-dict collectives) over the optimizer's own group, the param
  all-gathers over a second, the step's small all-reduces (its stats, a second norm type) over a
  third, the agreement at each collective entry point (``state_dict``...) over a fourth. A kind
  only ever pairs with its own kind. A rank that issued a different sequence waits in one space
  for a collective that the others issue only after their own wait in another space has
  finished: a deadlock, which the bounded wait ends, instead of a mispairing.
* Bounded waits. On the CPU every wait of ours is bounded by ``SHARDAMP_COLLECTIVE_TIMEOUT``
  seconds (read at each wait; unset: the process group's timeout), and whatever gloo raises is
  replaced by the error below.
* One report. A rank whose wait failed posts where it is (the collective, the steps it took, its
  backward passes since its last step) to the process group's store and reads the others' posts
  for as long as it waited itself (at most 30 s), so the error names every rank's position and
  the likely cause ("rank 1 took 2 steps, ranks 0, 2 took 3: a rank skipped step()").

On CUDA waits are ordered on streams: bounding them on the host would need a sync, so one group
carries everything and collective_watchdog.py's monitor thread watches completion events instead
(the same report, then the communicators are aborted; ``SHARDAMP_COLLECTIVE_WATCHDOG=force``
runs that path on gloo too, in place of the bounded waits). ``TORCH_DISTRIBUTED_DEBUG=DETAIL``
has torch compare every collective's kind and shapes first (one extra gloo all-gather and
barrier per collective: "Detected mismatch between collectives on ranks", on every rank, naming
each one's collective); with it set, gloo groups too carry everything in one group, so that
torch's check sees the mismatch.
"""
from __future__ import annotations

import concurrent.futures
import datetime
import json
import os
import threading
import time
from typing import Any, Callable, Dict, List, Optional

import torch
import torch.distributed as dist

from .. import _compat, config

TIMEOUT_ENV = "SHARDAMP_COLLECTIVE_TIMEOUT"
# How long a rank reads the others' posts: as long as it waited itself (a rank that began waiting
# later times out later), at most this.
REPORT_WAIT_S = 30.0

STATS = "the step's stats all-reduce"
SECOND_NORM = "the all-reduce of a second norm type"
REDUCE_SCATTER = "a gradient reduce-scatter (backward)"
REPLICAS = "the all-reduce of a grad shard over the replicas"
ALL_GATHER = "a param all-gather (end of step)"
NONFINITE_REPORT = "the all-gather of the ranks' non-finite grad flags (after a skipped step)"
GRAD_READS = "the all-reduce of per-param grad norms (p.grad norms: torch_tools.py, grads_view.py)"
AGREEMENT = "the agreement all-reduce of a collective call (state_dict, load_state_dict, save_sharded, load_sharded)"


def collective_timeout() -> Optional[float]:
    """``SHARDAMP_COLLECTIVE_TIMEOUT`` in seconds, None when unset (the group's timeout applies)."""
    return config.settings().collective_timeout


# ---------------------------------------------------------------- grad reads: a bounded arrival first
# A grad read (``p.grad.norm()``, ``opt.full_grad(p)``) is a collective, and the likeliest one to be
# called on one rank alone (``if rank == 0: log(p.grad.norm())``). Before its first collective,
# every rank posts its arrival to the process group's store and waits for the others' there, at
# most this long unless SHARDAMP_COLLECTIVE_TIMEOUT says otherwise: a rank alone raises in bounded
# time having issued NO collective, so the process group is not left holding a half-paired
# collective and the other ranks train on unaffected. The wait is HALF the bound of the others'
# waits (they wait in their next collective meanwhile): the lone rank raises, and may carry on,
# before they give up.
GRAD_READ_TIMEOUT_S = 30.0
_arrivals: Dict[str, int] = {}  # per span: grad reads every rank arrived at so far


def grad_read_timeout(comm: Any = None) -> float:
    """How long a grad read waits for the other ranks to arrive: half of
    ``SHARDAMP_COLLECTIVE_TIMEOUT`` when set; else :data:`GRAD_READ_TIMEOUT_S`, at most half the
    process group's timeout (``comm``'s, where it can be read)."""
    timeout = collective_timeout()
    if timeout is not None:
        return timeout / 2
    group = group_timeout_s(comm) if comm is not None else None
    return GRAD_READ_TIMEOUT_S if group is None else min(GRAD_READ_TIMEOUT_S, group / 2)


def arrive(comm: Any, what: str) -> None:
    """Every rank of ``comm``'s span arrives at the grad read ``what`` (a bounded wait on the
    store); else raise on this rank, naming the ranks that did not and the fix, with no collective
    issued. Nothing where there are no peers or no store.

    The ranks present are one store value (a ``0``/``1`` flag per rank) changed only by
    compare-and-set: a rank adds its flag; the one that completes the set posts "go"; a rank whose
    wait ran out removes its flag, unless the set is complete by then (then it goes too). So a
    peer arriving just as this rank gives up either completes the set first (every rank goes) or
    finds this rank withdrawn and waits, then withdraws in turn: no rank enters the read's
    collectives without every other. Every outcome leaves each rank's read index where the
    others' will be: advanced after a read every rank made, kept after a withdrawal (the state
    at that index is then as if this rank never came)."""
    store = _compat.default_store() if comm.has_peers else None
    if store is None:
        return
    space = comm.describe_span()
    n = _arrivals.get(space, 0)
    prefix = f"shardamp-grad-reads/{space}/"
    present, go = f"{prefix}{n}/present", f"{prefix}{n}/go"
    timeout = grad_read_timeout(comm)
    if _flip(store, present, comm.rank, comm.world_size, True) == "1" * comm.world_size:
        store.set(go, what)  # this rank completed the set
    try:
        store.wait([go], datetime.timedelta(seconds=timeout))
        failure: Optional[BaseException] = None
    except RuntimeError as exc:
        failure = exc
    if failure is not None:
        flags = _flip(store, present, comm.rank, comm.world_size, False)
        if flags is not None:  # withdrawn: the set was not complete
            missing = [r for r, f in enumerate(flags) if f != "1" and r != comm.rank]
            raise RuntimeError(_lone_read(what, comm, missing, timeout, failure)) from failure
        # complete as this rank gave up: every rank goes (the last one posts "go")
    _arrivals[space] = n + 1
    if n and comm.rank == 0:  # every rank arrived at read n, so each is done with read n - 1's keys
        for key in (f"{prefix}{n - 1}/present", f"{prefix}{n - 1}/go"):
            store.delete_key(key)


def _flip(store: Any, key: str, rank: int, world: int, arrive_: bool) -> Optional[str]:
    """Set (``arrive_``) or clear ``rank``'s flag in the ``0``/``1`` string at ``key`` by
    compare-and-set; returns the flags after. Clearing: None instead where every flag is set
    (the read goes: this rank stays)."""
    current = store.get(key).decode() if store.check([key]) else ""
    while True:
        flags = list(current or "0" * world)
        if not arrive_ and "0" not in flags:
            return None
        flags[rank] = "1" if arrive_ else "0"
        desired = "".join(flags)
        got = store.compare_set(key, current, desired).decode()
        if got == desired:
            return desired
        current = got  # another rank changed it meanwhile: again from what it holds now


def _lone_read(what: str, comm: Any, missing: List[int], timeout: float, exc: BaseException) -> str:
    setting = "half of SHARDAMP_COLLECTIVE_TIMEOUT" if collective_timeout() is not None else \
        "the default for grad reads; SHARDAMP_COLLECTIVE_TIMEOUT sets twice it"
    return (
        f"{what} is a collective: every rank of the optimizer's process group must call it at the same point. "
        f"This rank (rank {comm.rank}) called it and {_ranks(missing) if missing else 'the others'} did not "
        f"arrive within {timeout:g} s ({setting}). Call it on every rank (compute on every rank, print on "
        "one), or read opt.local_grad(p) for rank-local logging (this rank's slice, no collective). If every "
        "rank does call it but some arrive later than that (a long eval or checkpoint on one rank before a "
        "read every rank makes), raise SHARDAMP_COLLECTIVE_TIMEOUT (grad reads wait half of it). No "
        f"collective was issued: the other ranks are unaffected. ({_short(str(exc), 120)})"
    )


# ---------------------------------------------------------------- tag spaces
_side_groups: Dict[tuple, Any] = {}


def side_group(parent: Any, kind: str) -> Any:
    """A gloo group over ``parent``'s ranks (None = WORLD) for one kind of collective, created
    by every member at the same point (optimizer construction) and cached for later ones."""
    parent_pg = parent if parent is not None else dist.group.WORLD
    key = (kind, _compat.group_name(parent_pg))
    group = _side_groups.get(key)
    if group is not None and _compat.group_alive(group):
        return group
    group = dist.new_group(
        dist.get_process_group_ranks(parent_pg), timeout=_compat.group_timeout(parent_pg), backend="gloo",
        use_local_synchronization=True,  # only the members build it, as only they build the optimizer
    )
    _side_groups[key] = group
    return group


def uses_side_groups(group: Any, device: Optional[torch.device]) -> bool:
    """Tag spaces apply to gloo groups carrying CPU tensors, unless torch checks every collective
    itself (``TORCH_DISTRIBUTED_DEBUG=DETAIL``: its fingerprint check needs them in one group)."""
    if device is not None and device.type != "cpu":
        return False
    if os.environ.get("TORCH_DISTRIBUTED_DEBUG", "").strip().upper() == "DETAIL":
        return False
    backend = str(dist.get_backend(group))
    return backend == "gloo" or "cpu:gloo" in backend


# ---------------------------------------------------------------- bounded waits
class BoundedWork:
    """A collective's handle whose ``wait()`` is bounded and raises :func:`mismatch` on failure."""

    def __init__(self, work: Any, what: str, comm: Any) -> None:
        self.work, self.what, self.comm = work, what, comm

    def wait(self, *args: Any, **kwargs: Any) -> bool:
        wait(self.work, self.what, self.comm)
        return True


def wait(work: Any, what: str, comm: Any) -> None:
    timeout = collective_timeout()
    try:
        if timeout is None:
            work.wait()
        elif not _wait_within(work, timeout):
            raise RuntimeError(f"not completed within {timeout:g} s")
    except RuntimeError as exc:
        raise mismatch(comm, what, exc, timeout) from exc


_waiters: Optional[concurrent.futures.ThreadPoolExecutor] = None


def _wait_within(work: Any, timeout: float) -> bool:
    """Wait for ``work`` at most ``timeout`` seconds; False if it did not complete."""
    done = threading.Event()
    finish = when_done(work, done.set)
    if not done.wait(timeout):
        return False
    finish()
    return True


def when_done(work: Any, callback: Callable[[], None]) -> Callable[[], None]:
    """Call ``callback`` (from any thread) once ``work`` completed or failed; returns the
    function that then finishes it on the caller's thread (raising the backend's error)."""
    # gloo's wait(timeout) is not honoured by every collective (a reduce-scatter waits for the
    # group's timeout whatever it is given, and reports no completion before its wait)
    if work.is_completed():
        callback()
        return work.wait
    try:
        future = work.get_future()
    except RuntimeError:  # a reduce-scatter on gloo has none: wait on a helper thread
        future = None
    if future is not None:
        future.add_done_callback(lambda _: callback())
        return work.wait
    global _waiters
    if _waiters is None:
        # a wait that never completes keeps its thread until the group's timeout: room for several
        _waiters = concurrent.futures.ThreadPoolExecutor(max_workers=64, thread_name_prefix="shardamp-wait")
    pending = _waiters.submit(work.wait)
    pending.add_done_callback(lambda _: callback())
    return pending.result


def forget_side_groups(groups: List[Any]) -> None:
    """Drop aborted groups from the cache (a later optimizer over the parent builds new ones)."""
    for key in [k for k, g in _side_groups.items() if any(g is x for x in groups)]:
        del _side_groups[key]


# ---------------------------------------------------------------- the report
_incidents: Dict[str, int] = {}


def mismatch(comm: Any, what: str, exc: BaseException, timeout: Optional[float], mine: Optional[Dict[str, Any]] = None,
             waited: Optional[str] = None, source: str = "gloo") -> RuntimeError:
    """The error for a wait that failed: this rank's position (``mine``: where it was when it
    issued the collective; default: now), the others' (from the store), the likely cause and
    the fix."""
    mine = dict(comm.position(), waiting=what) if mine is None else mine
    reports = _exchange(comm, mine, timeout)
    if waited is None:
        waited = f"{timeout:g} s (SHARDAMP_COLLECTIVE_TIMEOUT)" if timeout is not None else "the process group's timeout"
    lines = "; ".join(
        f"rank {r}: " + (_where(reports[r]) if r in reports else "no report (not waiting in one of this "
                         "optimizer's collectives: it stopped calling the optimizer, is busy, or crashed)")
        for r in range(comm.world_size)
    )
    return RuntimeError(
        f"DistributedFusedAdam: the ranks disagree on the sequence of shardamp collectives. This rank "
        f"(rank {comm.rank}) waited {waited} in {what} at step {mine['steps'] + 1} and it did not "
        f"complete. {_cause(reports, comm.world_size)} Where each rank was: {lines}. Every rank must call "
        "backward(), step(), zero_grad(), grad_norm()/clip_grad_norm() and state_dict()/save_sharded()/"
        "load_state_dict()/load_sharded() in the same sequence (a different number of backward passes or "
        "a skipped step() on one rank desynchronises them); set SHARDAMP_COLLECTIVE_TIMEOUT (seconds) to "
        f"bound the wait. Nothing after this point is consistent across ranks: stop training. "
        f"({source}: {_short(str(exc))})"
    )


def _where(report: Dict[str, Any]) -> str:
    return (f"in {report['waiting']} ({report['steps']} steps taken, {report['backwards']} backward pass(es) "
            "since its last step)")


def _ranks(ranks: List[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


def _split(reports: Dict[int, Dict[str, Any]], key: str) -> Optional[str]:
    by: Dict[Any, List[int]] = {}
    for r in sorted(reports):
        by.setdefault(reports[r][key], []).append(r)
    if len(by) < 2:
        return None
    return ", ".join(f"{_ranks(rs)} {'took' if key == 'steps' else 'ran'} {v}" for v, rs in sorted(by.items()))


def _cause(reports: Dict[int, Dict[str, Any]], world_size: int) -> str:
    steps = _split(reports, "steps")
    if steps:
        return f"Likely cause: a rank skipped step() or called it when the others did not ({steps} steps)."
    dropped = [r for r in sorted(reports) if reports[r].get("dropped", 0)]
    if dropped and len(dropped) < len(reports):
        return (f"Likely cause: {_ranks(dropped)} skipped a step the others took (zero_grad() dropped "
                "gradients without step() since the last step).")
    backwards = _split(reports, "backwards")
    if backwards:
        return ("Likely cause: the ranks ran a different number of backward passes before step() (gradient "
                f"accumulation, or a skipped step() whose grads were kept) ({backwards} backward passes since "
                "their last step).")
    if len({reports[r]["waiting"] for r in reports}) > 1:
        return ("Likely cause: a collective was called on some ranks only (grad_norm()/clip_grad_norm() with "
                "another norm type, state_dict(), load_state_dict(), save_sharded(), load_sharded()).")
    if len(reports) < world_size:
        missing = [r for r in range(world_size) if r not in reports]
        return f"Likely cause: {_ranks(missing)} stopped issuing this optimizer's collectives."
    return "Likely cause: a collective was called on some ranks only."


def group_timeout_s(comm: Any, device_type: str = "cpu") -> Optional[float]:
    """Seconds of the timeout ``comm``'s whole span (None = WORLD) was built with for
    ``device_type``'s backend; None where it cannot be read."""
    timeout = _compat.group_timeout(comm.group if comm.group is not None else _compat.world_group(), device_type)
    return None if timeout is None else timeout.total_seconds()


def _exchange(comm: Any, mine: Dict[str, Any], timeout: Optional[float]) -> Dict[int, Dict[str, Any]]:
    """Post ``mine`` and collect the other ranks' posts of the same incident (bounded)."""
    reports = {comm.rank: mine}
    store = _compat.default_store()
    if store is None:
        return reports
    space = comm.describe_span()
    incident = _incidents.get(space, 0)
    _incidents[space] = incident + 1
    prefix = f"shardamp-collective-order/{space}/{incident}/"
    try:
        store.set(prefix + str(comm.rank), json.dumps(mine))
        if timeout is None:  # the group's timeout bounded the wait
            watchdog = getattr(comm, "watchdog", None)
            timeout = group_timeout_s(comm, watchdog.device.type if watchdog is not None else "cpu")
            timeout = REPORT_WAIT_S if timeout is None else timeout
        deadline = time.monotonic() + min(REPORT_WAIT_S, timeout)
        missing = [r for r in range(comm.world_size) if r != comm.rank]
        while missing:
            for r in list(missing):
                if store.check([prefix + str(r)]):
                    reports[r] = json.loads(store.get(prefix + str(r)).decode())
                    missing.remove(r)
            if not missing or time.monotonic() > deadline:
                break
            time.sleep(0.05)
    except (RuntimeError, ValueError):  # a store that failed too: report this rank alone
        pass
    return reports


def _short(text: str, limit: int = 240) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."
