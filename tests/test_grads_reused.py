"""torch's clip before unscale_, a second step without backward and a backward without
zero_grad train like unsharded torch at world 1 and 3 (the cases: grads_reused.py), with
torch's GradScaler, ShardedGradScaler and no scaler, an inf on one rank in one step."""
from __future__ import annotations

import functools
import math

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
