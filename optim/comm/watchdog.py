"""Ranks whose collectives do not line up when nothing waits on the host (NCCL, CUDA params).

On CUDA a collective is enqueued on a stream and ``work.wait()`` only orders another stream
after it: the host never waits, so a rank that skips ``step()``, runs an extra backward or an
extra all-reduce leaves the GPUs stuck in a collective that never completes while the host runs
on, until ProcessGroupNCCL's own watchdog (the process group's timeout, 10 min by default)
takes the process down with NCCL's message, or NCCL silently pairs collectives whose sizes
happen to match. Bounding the wait on the host would need a sync on every step. Instead, as
torch's own watchdog does, a per-process monitor thread watches completion handles recorded on
the host without waiting:

* Registration (main thread, per collective, no sync): when the optimizer orders a stream after
  a collective it records a CUDA event there (``event.query()`` never syncs; events are pooled)
  and appends ``(event, which collective, this rank's position, time)`` to its lane (one per
  stream: events of one stream complete in order, so the monitor queries the newest first and
  the oldest pending one only). About 5 us of host time per collective; no collective, no store
  traffic, no device work.
* Monitoring (daemon thread, every ``POLL_S``): a lane whose oldest pending entry made no
  progress for the bound (``SHARDAMP_COLLECTIVE_TIMEOUT`` seconds; unset: the process group's
  timeout less min(60 s, half of it), so this report comes before NCCL's watchdog) fails. As
  torch's watchdog, time counts from the host-side registration (or the lane's last completion,
  whichever is later), so the bound must exceed how long a collective may legitimately take
  after the host issued it, including how far the host runs ahead of the GPU.
* Failure (once per optimizer): the rank posts its position at that collective (the steps it
  took, its backward passes since its last step) to the process group's store and reads the
  other ranks' posts (collective_order.py: the same report and protocol as on gloo), logs the
  error, and aborts the communicators of the optimizer's process groups (``ProcessGroup.abort``:
  ProcessGroupNCCL stops its own watchdog without killing the process and runs ``ncclCommAbort``,
  which aborts the operations not completed: their kernels exit, so a main thread blocked in a
  sync elsewhere, ``loss.item()``, returns, with undefined data, instead of hanging; later
  collectives over those groups raise instead of hanging). The error then surfaces on the main thread at the next optimizer call (backward's
  reduce-scatter, ``step``, ``zero_grad``'s wait, ``state_dict``...): every later call raises
  it again. Nothing after that point is consistent across ranks.

On the CPU (gloo) the same watchdog replaces collective_order's bounded waits when
``SHARDAMP_COLLECTIVE_WATCHDOG=force`` (the tests use it to run this path without GPUs): a
wait blocks the main thread on a flag that the collective's completion or the monitor's failure
sets, which is what aborting the communicator does for a CUDA stream (gloo's ``abort()`` does
not end a wait already in flight, so it cannot serve there). ``SHARDAMP_COLLECTIVE_WATCHDOG=0``
turns the watchdog off (the process group's timeout applies). Not watched: collectives captured
in a CUDA graph (replays), and the state-dict gathers after a collective call's agreement.
"""
from __future__ import annotations

import collections
import logging
import threading
import time
import weakref
from typing import Any, Callable, Deque, Dict, List, Optional

import torch

from .. import _compat, config, kernels
from . import order as collective_order

ENV = "SHARDAMP_COLLECTIVE_WATCHDOG"
POLL_S = 0.1  # how often the monitor looks: detection within the bound plus this
# SHARDAMP_COLLECTIVE_TIMEOUT unset: the process group's timeout less this margin (at most half
# of it), so the report (its store reads take up to collective_order.REPORT_WAIT_S) comes before
# NCCL's own watchdog ends the process, while ranks that drift apart by nearly the timeout (a
# long evaluation or save on one rank) still run, as NCCL lets them
DEFAULT_MARGIN_S = 60.0
FALLBACK_BOUND_S = 540.0  # NCCL's default 10 min less the margin, where the timeout cannot be read

_log = logging.getLogger("shardamp")


def mode() -> str:
    """``SHARDAMP_COLLECTIVE_WATCHDOG``: ``"on"`` (default: CUDA params), ``"off"`` or ``"force"``."""
    return config.settings().collective_watchdog


def wanted(device: Optional[torch.device]) -> bool:
    """Whether a comm over params on ``device`` is watched (CPU: only when forced)."""
    m = mode()
    return m == "force" or (m == "on" and device is not None and device.type != "cpu")


class _Entry:
    __slots__ = ("probe", "what", "position", "since", "bound", "event", "finished")

    def __init__(self, what: str, position: Dict[str, int], bound: float) -> None:
        self.what, self.position, self.bound = what, position, bound
        self.since = time.monotonic()
        self.event: Any = None
        self.finished = False
        self.probe: Callable[[], bool] = self._finished

    def _finished(self) -> bool:
        return self.finished


class _Lane:
    __slots__ = ("entries", "ordered", "progress")

    def __init__(self, ordered: bool) -> None:
        self.entries: Deque[_Entry] = collections.deque()
        self.ordered = ordered  # entries complete in registration order (one CUDA stream)
        self.progress = 0.0  # when an entry last completed


class Watchdog:
    """The collectives one comm (one optimizer) has ordered streams after, and their failure."""

    def __init__(self, comm: Any, device: torch.device) -> None:
        # weakly: the comm holds its watchdog, and a strong reference back would be a cycle that
        # keeps both (and the monitor polling them) alive after the optimizer is dropped, until
        # Python's cyclic collector ran
        self._comm = weakref.ref(comm)
        self.cuda, self.device = device.type == "cuda", device
        self.lanes: Dict[Any, _Lane] = {}
        self.lock = threading.Lock()
        self.wakes: "weakref.WeakSet[threading.Event]" = weakref.WeakSet()  # CPU waits in progress
        self.events: List[Any] = []  # CUDA events free for reuse
        self.message: Optional[str] = None  # the failure, raised at every later call
        self.failing = False  # a report is under way or done
        self.reported = threading.Event()
        self.aborted: List[str] = []  # names of the groups aborted on failure
        self.default_bound = self._default_bound(device)
        ext = kernels.native_module(device) if self.cuda else None
        self.native = ext if ext is not None and hasattr(ext, "event_query_relaxed") else None
        _start_monitor(self)

    @property
    def comm(self) -> Any:
        comm = self._comm()
        if comm is None:
            raise RuntimeError("shardamp collective watchdog: its optimizer's comm is gone")
        return comm

    def _default_bound(self, device: torch.device) -> float:
        seconds = collective_order.group_timeout_s(self.comm, device.type)
        if seconds is None:
            _log.warning("shardamp collective watchdog: the process group's timeout could not be read; "
                         "stalled collectives are reported after %.0f s (set %s to choose)",
                         FALLBACK_BOUND_S, collective_order.TIMEOUT_ENV)
            return FALLBACK_BOUND_S
        return seconds - min(DEFAULT_MARGIN_S, seconds / 2)

    def bound(self) -> float:
        configured = collective_order.collective_timeout()
        return configured if configured is not None else self.default_bound

    # ------------------------------------------------------------ main thread
    def check(self) -> None:
        """Raise the failure, if the monitor found one (every optimizer call that communicates)."""
        if self.message is not None:
            raise RuntimeError(self.message)

    def wait(self, work: Any, what: str) -> None:
        """``work.wait()`` as the backend does it (CUDA: orders the current stream after the
        collective, no host wait), watched from here on."""
        self.check()
        if not self.cuda:
            return self._wait_on_host(work, what)
        try:
            work.wait()
        except RuntimeError:
            self.check()  # a communicator aborted by the monitor: its error, not torch's
            raise
        mark = self._mark()
        if mark is None:
            return None
        entry = _Entry(what, self.comm.position(), self.bound())
        entry.event, entry.probe = mark[1], self._probe(mark[1])
        self._register(mark[0], entry, ordered=True)
        return None

    def _probe(self, event: Any) -> Callable[[], bool]:
        """Whether ``event`` has completed, asked from the monitor thread. Natively in relaxed
        capture mode: a plain ``cudaEventQuery`` from another thread invalidates a CUDA graph
        being captured in the default (global) mode."""
        native = self.native
        if native is None:
            return event.query
        handle = _compat.cuda_event_handle(event)

        def done() -> bool:
            state = native.event_query_relaxed(handle)
            if state < 0:
                raise RuntimeError("cudaEventQuery failed on a collective's completion event")
            return state == 1

        return done

    def _mark(self) -> Optional[tuple]:
        """``(lane key, event)``: a (pooled) event recorded on the current stream, which completes
        once the collective the stream was just ordered after has; None during graph capture."""
        if torch.cuda.is_current_stream_capturing():
            return None  # graph replays are not watched
        try:
            event = self.events.pop()
        except IndexError:
            event = torch.cuda.Event()
        event.record()
        return torch.cuda.current_stream().cuda_stream, event

    def _wait_on_host(self, work: Any, what: str) -> None:
        entry = _Entry(what, self.comm.position(), self.bound())
        wake = threading.Event()
        self.wakes.add(wake)

        def done() -> None:
            entry.finished = True
            wake.set()

        finish = collective_order.when_done(work, done)
        self._register("cpu", entry, ordered=False)
        if self.message is None:  # set before the report wakes the waits: none is missed
            wake.wait()
        self.check()
        try:
            finish()  # the backend's own error, if the collective failed (e.g. its timeout)
        except RuntimeError as exc:
            self.fail(entry, f"the backend reported: {exc}")
            self.check()
            raise

    def _register(self, key: Any, entry: _Entry, ordered: bool) -> None:
        with self.lock:
            lane = self.lanes.get(key)
            if lane is None:
                lane = self.lanes[key] = _Lane(ordered)
            if not lane.entries:
                lane.progress = entry.since
            lane.entries.append(entry)

    # ------------------------------------------------------------ monitor thread
    def poll(self, now: float) -> None:
        """Drop completed entries; fail if a lane's oldest pending one is past its bound."""
        if self.failing:
            return
        if self.device.type == "cuda":
            with torch.cuda.device(self.device):  # this thread queries the events of our device
                return self._poll(now)
        return self._poll(now)

    def _poll(self, now: float) -> None:
        stuck = None
        with self.lock:
            for lane in self.lanes.values():
                entries = lane.entries
                if not entries:
                    continue
                if lane.ordered:
                    n = len(entries)
                    if entries[n - 1].probe():  # the newest completed: so did every older one
                        done = [entries.popleft() for _ in range(n)]
                    else:
                        done = []
                        while entries and entries[0].probe():
                            done.append(entries.popleft())
                    self.events.extend(e.event for e in done)
                else:
                    kept = [e for e in entries if not e.probe()]
                    done = [None] * (len(entries) - len(kept))
                    lane.entries = entries = collections.deque(kept)
                if done:
                    lane.progress = now
                if entries:
                    oldest = entries[0] if lane.ordered else min(entries, key=lambda e: e.since)
                    if now - max(oldest.since, lane.progress) > oldest.bound:
                        stuck = oldest
        if stuck is not None and self._claim():
            threading.Thread(target=self._report, args=(stuck, None), name="shardamp-watchdog-report",
                             daemon=True).start()

    def _claim(self) -> bool:
        """True for the one caller that reports; the failure is reported once per optimizer."""
        with self.lock:
            if self.failing:
                return False
            self.failing = True
            return True

    def fail(self, entry: _Entry, reason: str) -> None:
        """A wait the backend itself ended with an error (its timeout, a peer that aborted): report
        it from this thread, or wait for the report already under way."""
        if self._claim():
            self._report(entry, reason)
        else:
            self.reported.wait(collective_order.REPORT_WAIT_S + 5.0)

    def _report(self, entry: _Entry, reason: Optional[str]) -> None:
        """Report ``entry``'s collective as stuck on every rank (store), abort, wake the waits."""
        configured = collective_order.collective_timeout() is not None
        waited = (f"{entry.bound:g} s (SHARDAMP_COLLECTIVE_TIMEOUT)" if configured else
                  f"{entry.bound:g} s (the process group's timeout less min(60 s, half of it), the default; SHARDAMP_COLLECTIVE_TIMEOUT "
                  "sets it)")
        reason = reason or f"not completed within {entry.bound:g} s"
        comm = self._comm()
        if comm is None:  # its optimizer is gone: nothing to abort for it (and nobody should wait)
            self.reported.set()
            for wake in list(self.wakes):
                wake.set()
            return
        groups = comm.all_groups()
        try:
            error = collective_order.mismatch(
                comm, entry.what, RuntimeError(reason), entry.bound, mine=dict(entry.position, waiting=entry.what),
                waited=waited, source="shardamp's collective watchdog, which then aborted the communicators of the "
                "optimizer's process groups so that no rank hangs")
            message = str(error)
        except Exception as exc:  # noqa: BLE001  (the report must never keep a rank from failing)
            message = f"DistributedFusedAdam: {entry.what} did not complete within {waited} ({exc})"
        self.message = message
        _log.error("%s", message)  # visible even if the main thread next fails elsewhere
        self.aborted = [n for n in (_abort(g) for g in groups) if n is not None]
        collective_order.forget_side_groups(groups)
        self.reported.set()
        for wake in list(self.wakes):
            wake.set()


def _abort(group: Any) -> Optional[str]:
    try:
        name = _compat.group_name(group)
        _compat.abort_group(group)
        return name
    except Exception:  # noqa: BLE001  (already destroyed, or a backend without abort)
        return None


class WatchedWork:
    """A collective's handle whose ``wait()`` goes through the comm's :class:`Watchdog`."""

    def __init__(self, work: Any, what: str, watchdog: Watchdog) -> None:
        self.work, self.what, self.watchdog = work, what, watchdog

    def wait(self, *args: Any, **kwargs: Any) -> bool:
        self.watchdog.wait(self.work, self.what)
        return True


# ---------------------------------------------------------------- the monitor thread
_watched: "weakref.WeakSet[Watchdog]" = weakref.WeakSet()
_thread: Optional[threading.Thread] = None
_thread_lock = threading.Lock()


def _start_monitor(watchdog: Watchdog) -> None:
    global _thread
    with _thread_lock:
        _watched.add(watchdog)
        if _thread is None or not _thread.is_alive():
            _thread = threading.Thread(target=_monitor, name="shardamp-watchdog", daemon=True)
            _thread.start()


def _monitor() -> None:
    logged = set()  # a failing poll is logged once per watchdog and message, not every POLL_S
    while True:
        time.sleep(POLL_S)
        now = time.monotonic()
        for watchdog in list(_watched):
            try:
                watchdog.poll(now)
            except Exception as exc:  # noqa: BLE001  (a monitor that died would watch nothing)
                key = (id(watchdog), str(exc))
                if key not in logged:
                    logged.add(key)
                    _log.warning("shardamp collective watchdog: poll failed: %s", exc)
        watchdog = None  # not held through the sleep: a dropped optimizer's watchdog goes at once
