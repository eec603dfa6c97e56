"""torch's clip before unscale_, a second step without backward and a backward without
zero_grad train like unsharded torch at world 1 and 3 (the cases: grads_reused.py), with
torch's GradScaler, ShardedGradScaler and no scaler, an inf on one rank in one step."""
from __future__ import annotations

import functools
import math
import time

import pytest
import torch

import grads_reused
from dist_helper import case_values, run_cases, run_distributed
from parity import ATOL, RTOL

WORLDS = [1, 3]


@functools.lru_cache(maxsize=None)
def _results(world: int):
    return run_distributed(run_cases, world, "grads_reused", grads_reused.ALL)


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("case", [c for c in grads_reused.ALL if c != "case_read_on_one_rank"])
def test_matches_torch(world: int, case: str) -> None:
    values = case_values(_results(world), case)
    v0 = values[0]
    scaled = not case.endswith("_none")
    clipped = False
    for step in range(grads_reused.STEPS):
        what = f"{case} step {step}"
        for i, (ours, ref) in enumerate(zip(v0["ours"][step], v0["ref"][step])):
            torch.testing.assert_close(ours, ref, rtol=RTOL, atol=ATOL, msg=lambda m: f"{what} param {i}: {m}")
        ref_grads = v0["ref_grads"][step]
        # backward_after_unscale with a scaler: the second backward's grads stay scaled (torch's scaler
        # does not unscale twice), so their round-off is the loss scale's times
        atol = ATOL * max(v0["ref_scale"]) if scaled and case.startswith("case_backward_after_unscale") else ATOL
        if all(g is not None and torch.isfinite(g).all() for g in ref_grads):
            for i, (ours, ref) in enumerate(zip(v0["grads"][step], ref_grads)):
                # what p.grad shows after the step(s) is torch's p.grad (unscaled, clipped)
                torch.testing.assert_close(ours, ref, rtol=RTOL, atol=atol, msg=lambda m: f"{what} grad {i}: {m}")
        ref_norm, norm = v0["ref_norm"][step], v0["norm"][step]
        if math.isfinite(ref_norm):
            assert math.isclose(norm, ref_norm, rel_tol=1e-5), (what, norm, ref_norm)
            clipped |= ref_norm > v0["threshold"][step]
        else:
            assert scaled and step == grads_reused.INF_STEP and not math.isfinite(norm), (what, norm)
        assert v0["scale"][step] == v0["ref_scale"][step], what
    assert clipped, "the clip never engaged: the test would not catch a missing clip"
    for other in values[1:]:  # every rank the same params
        for s in range(grads_reused.STEPS):
            for a, b in zip(v0["ours"][s], other["ours"][s]):
                assert torch.equal(a, b)
    # torch's clip before unscale_ is torch's behaviour: nothing to warn about; nor "as torch does"
    assert not [w for w in v0["warnings"] if "before unscaling" in w or "clipped nothing" in w], v0["warnings"]
    added = [w for w in v0["warnings"] if "without opt.zero_grad()" in w]
    if case.startswith("case_no_zero_grad_"):  # the warning says the new grads add to what param.grad showed
        assert len(added) == 1 and "ADDED to the grads that step left, as param.grad showed them" in added[0], added
    else:
        assert not added, added


@pytest.mark.parametrize("world", WORLDS)
def test_a_grad_read_on_one_rank_fails_there_in_bounded_time(world: int) -> None:
    """``p.grad.norm()`` / ``full_grad`` on rank 0 alone: an error there within the read timeout
    naming the fix, nothing on the others, and the group keeps training (and reading) like torch."""
    values = case_values(_results(world), "case_read_on_one_rank")
    for rank, v in enumerate(values):
        if world > 1 and rank == 0:
            assert len(v["errors"]) == 2, v["errors"]
            for (message, elapsed), what in zip(v["errors"], ("the norm of p.grad", "full_grad")):
                assert message.startswith(f"{what} is a collective"), message
                assert "opt.local_grad(p)" in message and "ranks 1" in message and "No collective was issued" in message
                assert grads_reused.READ_TIMEOUT / 2 <= elapsed < grads_reused.READ_TIMEOUT / 2 + 15, elapsed
        else:
            assert not v["errors"], v["errors"]  # at world 1 every read is local
        for step in range(len(v["ours"])):
            for ours, ref in zip(v["ours"][step], v["ref"][step]):
                torch.testing.assert_close(ours, ref, rtol=RTOL, atol=ATOL)
            for ours, ref in zip(v["norms"][step], v["ref_norms"][step]):
                assert math.isclose(ours, ref, rel_tol=1e-5), (step, ours, ref)


def test_grad_reads_wait_well_under_a_minute_by_default(monkeypatch) -> None:
    from conftest import set_env
    from shardamp.optim.comm import order

    monkeypatch.delenv("SHARDAMP_COLLECTIVE_TIMEOUT", raising=False)
    from shardamp.optim import config

    config.reload()
    assert order.grad_read_timeout() == order.GRAD_READ_TIMEOUT_S <= 30.0
    set_env(monkeypatch, "SHARDAMP_COLLECTIVE_TIMEOUT", "7")
    assert order.grad_read_timeout() == 3.5  # half: the other ranks wait the whole of it meanwhile


class _Rank:
    """The part of a comm ``order.arrive`` reads: rank ``rank`` of ``world`` in one span."""

    has_peers = True

    def __init__(self, rank: int, world: int) -> None:
        self.rank, self.world_size = rank, world

    def describe_span(self) -> str:
        return "test-span"


class _Store:
    """A FileStore whose first ``wait`` runs ``before_timeout`` (another rank's move) and then
    times out (``times_out``) or waits."""

    def __init__(self, store, before_timeout=None, times_out: bool = True) -> None:
        self.store, self.before_timeout, self.times_out = store, before_timeout, times_out

    def __getattr__(self, name):
        return getattr(self.store, name)

    def wait(self, keys, timeout):
        if self.before_timeout is None:
            return self.store.wait(keys, timeout)
        move, self.before_timeout = self.before_timeout, None
        move()
        if not self.times_out:
            return self.store.wait(keys, timeout)
        raise RuntimeError("Wait timeout")


def test_a_rank_arriving_as_another_gives_up_never_enters_the_read_alone(monkeypatch, tmp_path) -> None:
    """The withdrawal is a compare-and-set on the one value naming the ranks present: a peer that
    arrives just after rank 0's wait ran out either completes the set before rank 0 withdraws
    (both go) or finds rank 0 withdrawn (it waits, withdraws and raises in turn); every outcome
    leaves the ranks' read indices in step, so their next read pairs."""
    import threading

    from conftest import set_env
    from shardamp.optim.comm import order

    set_env(monkeypatch, "SHARDAMP_COLLECTIVE_TIMEOUT", "1")  # grad reads wait 0.5 s
    store = torch.distributed.FileStore(str(tmp_path / "store"), 1)
    monkeypatch.setattr(order, "_arrivals", {})
    counters = [dict(), dict()]

    def arrive_as(rank: int, wrapped) -> None:
        monkeypatch.setattr(order._compat, "default_store", lambda: wrapped)
        order._arrivals = counters[rank]
        order.arrive(_Rank(rank, 2), "the norm of p.grad")

    # 1. rank 1 arrives after rank 0's wait ran out but before it withdraws: the set is complete, both go
    def rank1_arrives() -> None:
        arrive_as(1, store)  # completes the set: goes at once
        order._arrivals = counters[0]  # back to rank 0, in its wait
    arrive_as(0, _Store(store, rank1_arrives))
    assert counters == [{"test-span": 1}, {"test-span": 1}]
    # 2. rank 1 arrives just after rank 0 withdrew: it finds rank 0 gone, raises in bounded time too
    with pytest.raises(RuntimeError, match=r"rank 0\) called it and ranks? 1 did not arrive") as lone:
        arrive_as(0, store)
    assert "raise SHARDAMP_COLLECTIVE_TIMEOUT" in str(lone.value)
    began = time.monotonic()
    with pytest.raises(RuntimeError, match=r"rank 1\) called it and ranks? 0 did not arrive"):
        arrive_as(1, store)
    assert 0.5 <= time.monotonic() - began < 5
    assert counters == [{"test-span": 1}, {"test-span": 1}]  # in step: neither read happened
    # 3. the next read every rank makes pairs, at the index both kept (rank 1 arrives while rank 0 waits)
    def rank1_reads() -> None:
        arrive_as(1, store)
        order._arrivals = counters[0]
    arrive_as(0, _Store(store, rank1_reads, times_out=False))
    assert counters == [{"test-span": 2}, {"test-span": 2}]
    assert not store.check(["shardamp-grad-reads/test-span/0/present"])  # read 0's keys cleaned up
