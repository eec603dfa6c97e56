"""collective_watchdog.py's logic in one process: the CUDA path's lanes (events of one stream
complete in order), the clock, the report, the abort and the sticky error, with fake events and
a fake comm (no GPU here; the multi-rank behaviour is in test_agreement.py, on gloo with the
watchdog forced)."""
from __future__ import annotations

import os
import threading
import time

import pytest
import torch

from shardamp.optim import config

from conftest import set_env

from shardamp.optim import _compat
from shardamp.optim.comm import watchdog as collective_watchdog
from shardamp.optim.comm.order import STATS, REDUCE_SCATTER


class FakeEvent:
    def __init__(self) -> None:
        self.done = False
        self.queries = 0

    def query(self) -> bool:
        self.queries += 1
        return self.done


class FakeWork:
    def __init__(self) -> None:
        self.waited = 0

    def wait(self) -> bool:
        self.waited += 1  # on CUDA: orders the current stream after the collective, returns at once
        return True


class FakeComm:
    world_size, rank, group = 1, 0, None

    def __init__(self) -> None:
        self.steps, self.backwards = 0, 0
        self.groups = [object(), object()]

    def position(self):
        return {"steps": self.steps, "backwards": self.backwards, "dropped": 0}

    def describe_span(self) -> str:
        return "fake"

    def all_groups(self):
        return self.groups


def _new_watchdog(device: torch.device) -> collective_watchdog.Watchdog:
    """A Watchdog over a FakeComm that it keeps alive (a watchdog holds its comm weakly)."""
    comm = FakeComm()
    wd = collective_watchdog.Watchdog(comm, device)
    wd.test_comm = comm
    return wd


@pytest.fixture
def watchdog(monkeypatch):
    """A CUDA-path watchdog whose events come from ``marks`` (lane key, FakeEvent)."""
    set_env(monkeypatch, "SHARDAMP_COLLECTIVE_TIMEOUT", "0.5")
    aborted = []
    monkeypatch.setattr(_compat, "abort_group", aborted.append)
    monkeypatch.setattr(_compat, "group_name", lambda g: f"group{id(g)}")
    wd = _new_watchdog(torch.device("cpu"))
    collective_watchdog._watched.discard(wd)  # polled by the test, not by the monitor thread
    wd.cuda = True
    wd.marks = []
    wd._mark = lambda: wd.marks.pop(0)
    wd.aborted_groups = aborted
    return wd


def _issue(wd, lane, what=STATS):
    event = FakeEvent()
    wd.marks.append((lane, event))
    work = FakeWork()
    wd.wait(work, what)
    assert work.waited == 1
    return event


def _report_done(wd, timeout=10.0):
    assert wd.reported.wait(timeout), "the report thread did not finish"


def test_completed_lanes_are_dropped_newest_first_and_events_reused(watchdog):
    events = [_issue(watchdog, "stream A", REDUCE_SCATTER) for _ in range(3)]
    other = _issue(watchdog, "stream B")
    now = time.monotonic()
    events[-1].done = True  # the newest of lane A: every older one completed too (one stream)
    watchdog.poll(now)
    assert not watchdog.lanes["stream A"].entries and [e.queries for e in events] == [0, 0, 1]
    assert list(watchdog.lanes["stream B"].entries)[0].event is other
    assert sorted(map(id, watchdog.events)) == sorted(map(id, events))  # back in the pool
    watchdog.poll(now + 0.4)  # lane B pending, within the bound
    assert watchdog.message is None


def test_stuck_collective_reports_aborts_and_raises_at_every_later_call(watchdog):
    watchdog.comm.steps, watchdog.comm.backwards = 4, 1
    first = _issue(watchdog, "stream A", REDUCE_SCATTER)
    _issue(watchdog, "stream A", STATS)
    watchdog.comm.steps = 9  # the host ran on: the report names where the rank was at the collective
    first.done = True
    t = time.monotonic()
    watchdog.poll(t)  # the first landed: the lane's clock restarts now
    watchdog.poll(t + 0.4)
    assert watchdog.message is None
    watchdog.poll(t + 0.6)
    _report_done(watchdog)
    message = watchdog.message
    assert "This rank (rank 0) waited 0.5 s (SHARDAMP_COLLECTIVE_TIMEOUT) in the step's stats all-reduce at step 5" \
        in message, message
    assert "shardamp's collective watchdog" in message
    assert watchdog.aborted_groups == watchdog.comm.groups and len(watchdog.aborted) == 2
    for _ in range(2):
        with pytest.raises(RuntimeError, match="the ranks disagree on the sequence of shardamp collectives"):
            watchdog.wait(FakeWork(), STATS)
        with pytest.raises(RuntimeError, match="waited 0.5 s"):
            watchdog.check()


def test_default_bound_is_the_group_timeout_less_a_margin(monkeypatch):
    """Unset SHARDAMP_COLLECTIVE_TIMEOUT: the group's timeout less min(60 s, half of it), so the
    report comes before NCCL's watchdog while a rank may still run ahead by nearly the timeout."""
    import datetime

    monkeypatch.delenv("SHARDAMP_COLLECTIVE_TIMEOUT", raising=False)
    for minutes, bound in ((10, 540.0), (120, 7140.0), (1, 30.0)):
        monkeypatch.setattr(_compat, "group_timeout",
                            lambda group, device_type, m=minutes: datetime.timedelta(minutes=m))
        wd = _new_watchdog(torch.device("cpu"))
        collective_watchdog._watched.discard(wd)
        assert wd.bound() == bound, minutes
    monkeypatch.setattr(_compat, "group_timeout", lambda group, device_type: None)
    wd = _new_watchdog(torch.device("cpu"))
    collective_watchdog._watched.discard(wd)
    assert wd.bound() == collective_watchdog.FALLBACK_BOUND_S == 540.0


def test_a_host_wait_is_woken_by_the_report(watchdog):
    """The CPU path (forced on gloo): a wait blocks on a flag the report sets."""
    watchdog.cuda = False

    class Never:  # a collective that never completes (no future: waited on a helper thread)
        def is_completed(self):
            return False

        def get_future(self):
            raise RuntimeError("no future")

        def wait(self):
            threading.Event().wait(30)

    raised = []

    def main():
        try:
            watchdog.wait(Never(), REDUCE_SCATTER)
        except RuntimeError as exc:
            raised.append(str(exc))

    thread = threading.Thread(target=main)
    thread.start()
    time.sleep(0.2)
    watchdog.poll(time.monotonic() + 1.0)
    _report_done(watchdog)
    thread.join(10)
    assert not thread.is_alive() and "in a gradient reduce-scatter (backward)" in raised[0]


@pytest.mark.parametrize("value, expected", [("", "on"), ("1", "on"), ("0", "off"), ("force", "force")])
def test_mode(monkeypatch, value, expected):
    set_env(monkeypatch, collective_watchdog.ENV, value)
    assert collective_watchdog.mode() == expected
    assert collective_watchdog.wanted(torch.device("cpu")) == (expected == "force")
    assert collective_watchdog.wanted(torch.device("cuda", 0)) == (expected != "off")


def test_bad_mode_names_the_variable(monkeypatch):
    with pytest.raises(ValueError, match="SHARDAMP_COLLECTIVE_WATCHDOG='yes'"):
        set_env(monkeypatch, collective_watchdog.ENV, "yes")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_cuda_events_and_the_monitor_thread(monkeypatch):
    """The CUDA-only pieces: the event recorded on the current stream without a sync, the real
    monitor thread querying it under its device guard; a stream kept busy past the bound (the
    GPU spinning, standing in for a collective that never completes) is reported."""
    set_env(monkeypatch, "SHARDAMP_COLLECTIVE_TIMEOUT", "0.5")
    aborted = []
    monkeypatch.setattr(_compat, "abort_group", aborted.append)
    monkeypatch.setattr(_compat, "group_name", lambda g: f"group{id(g)}")
    wd = _new_watchdog(torch.device("cuda", torch.cuda.current_device()))
    torch.cuda.set_sync_debug_mode("error")
    try:
        wd.wait(FakeWork(), STATS)  # an idle stream: its event completes at once
    finally:
        torch.cuda.set_sync_debug_mode(0)
    deadline = time.monotonic() + 5.0
    while any(lane.entries for lane in wd.lanes.values()) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(lane.entries for lane in wd.lanes.values()) and len(wd.events) == 1
    spin = getattr(torch.cuda, "_sleep", None)
    if spin is None:
        pytest.skip("torch.cuda._sleep is gone")
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        spin(int(4e9))  # about 2 s of GPU cycles on this stream
        wd.wait(FakeWork(), REDUCE_SCATTER)
    assert wd.reported.wait(10), "the monitor thread did not report"
    assert "in a gradient reduce-scatter (backward)" in wd.message and len(aborted) == 2
    assert list(wd.lanes) == [torch.cuda.current_stream().cuda_stream, side.cuda_stream]
    torch.cuda.synchronize()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_the_monitor_polling_during_a_graph_capture_leaves_it_valid(monkeypatch):
    """A plain cudaEventQuery from another thread while a global-mode capture runs invalidates
    that capture; the monitor queries in relaxed mode. The watched event sits behind a kernel
    spinning on a stream outside the capture, so it is still pending while the capture (begun by
    hand: ``torch.cuda.graph`` synchronizes first) lasts ~10 polls; the queries made inside the
    capture are counted, and the captured graph must still end and replay."""
    spin = getattr(torch.cuda, "_sleep", None)
    if spin is None:
        pytest.skip("torch.cuda._sleep is gone")
    set_env(monkeypatch, "SHARDAMP_COLLECTIVE_TIMEOUT", "60")
    monkeypatch.setattr(_compat, "group_name", lambda g: f"group{id(g)}")
    wd = _new_watchdog(torch.device("cuda", torch.cuda.current_device()))
    if wd.native is None:
        pytest.skip("the CUDA kernels did not build")
    capturing = threading.Event()
    pending_inside = []

    class Counting:  # the extension's query, counted while the capture runs
        def __init__(self, real):
            self.real = real

        def event_query_relaxed(self, handle):
            state = self.real.event_query_relaxed(handle)
            if capturing.is_set() and state == 0:
                pending_inside.append(state)
            return state

    wd.native = Counting(wd.native)
    x = torch.ones(1024, device="cuda")
    side, capture_stream = torch.cuda.Stream(), torch.cuda.Stream()
    torch.cuda.synchronize()
    with torch.cuda.stream(side):
        spin(int(5e9))  # ~2.5 s: the event behind it stays pending through the capture
        wd.wait(FakeWork(), STATS)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(capture_stream):
        graph.capture_begin()  # capture_error_mode "global", torch's default
        capturing.set()
        y = x * 2
        time.sleep(1.0)
        y = y + 1
        capturing.clear()
        graph.capture_end()  # raises if a query from the monitor invalidated the capture
    assert len(pending_inside) >= 3, f"the monitor queried the pending event {len(pending_inside)} times"
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(y, torch.full_like(x, 3.0)) and not wd.reported.is_set()


def _nccl_abort_case(rank: int, world: int) -> dict:
    """In a spawned NCCL rank: the report aborts a real NCCL group (ProcessGroupNCCL.abort()
    through _compat.abort_group), and a collective over it afterwards raises, not hangs."""
    import torch.distributed as dist

    os.environ["SHARDAMP_COLLECTIVE_TIMEOUT"] = "0.5"
    config.reload()  # settings are read once per process
    group = dist.new_group(backend="nccl")
    x = torch.ones(4, device="cuda")
    dist.all_reduce(x, group=group)  # the communicator exists before it is aborted
    comm = FakeComm()
    comm.groups = [group]
    wd = collective_watchdog.Watchdog(comm, torch.device("cuda", torch.cuda.current_device()))
    torch.cuda._sleep(int(2e9))
    wd.wait(dist.all_reduce(x, group=group, async_op=True), STATS)
    reported = wd.reported.wait(20)
    torch.cuda.synchronize()
    try:
        wd.check()
        sticky = None
    except RuntimeError as exc:
        sticky = str(exc)
    try:
        dist.all_reduce(x, group=group)
        torch.cuda.synchronize()
        after = "no error"
    except Exception as exc:  # noqa: BLE001
        after = type(exc).__name__
    return dict(reported=reported, aborted=list(wd.aborted), sticky=sticky, after=after)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_a_report_aborts_a_real_nccl_group():
    from dist_helper import run_distributed

    (res,) = run_distributed(_nccl_abort_case, 1, backend="nccl", timeout=120)
    assert res["reported"] and len(res["aborted"]) == 1, res
    assert res["sticky"] and "did not complete" in res["sticky"], res
    assert res["after"] != "no error", res


def test_a_dropped_comm_frees_its_watchdog_without_the_cyclic_gc(monkeypatch):
    """A comm holds its watchdog and the watchdog its comm only weakly: dropping the comm (its
    optimizer) frees both by refcounting, so the monitor thread stops polling it at once; a
    report for a comm that is gone does nothing and raises nothing."""
    import gc
    import weakref

    monkeypatch.setattr(_compat, "abort_group", lambda g: pytest.fail("nothing to abort: the comm is gone"))
    comm = FakeComm()
    comm.watchdog = collective_watchdog.Watchdog(comm, torch.device("cpu"))  # as Comm does
    ref = weakref.ref(comm.watchdog)
    assert ref() in collective_watchdog._watched
    survivor = collective_watchdog.Watchdog(FakeComm(), torch.device("cpu"))  # its comm dies at once
    collective_watchdog._watched.discard(survivor)
    gc.collect()
    gc.disable()
    try:
        del comm
        for _ in range(200):  # the monitor thread holds each watchdog for the moment of its poll
            if ref() is None:
                break
            time.sleep(0.01)
        assert ref() is None, "the watchdog outlived its comm"
    finally:
        gc.enable()
    with pytest.raises(RuntimeError, match="comm is gone"):
        survivor.comm
    entry = collective_watchdog._Entry(STATS, {"steps": 0, "backwards": 0, "dropped": 0}, 0.5)
    survivor._report(entry, "stuck")
    assert survivor.reported.is_set() and survivor.message is None and survivor.aborted == []
