"""The AMP loops A-G (tests/amp_loops.py says what each is) at world 2 and 3 with an inf on one rank, against torch.amp.GradScaler
+ unsharded torch.optim.AdamW + torch.nn.utils.clip_grad_norm_."""
from __future__ import annotations

import functools
import math

import pytest
import torch

import cases_scaler
from amp_loops import INF_STEP, MAX_NORM, SPIKE_ABOVE, SPIKE_STEPS
from dist_helper import case_values, run_cases, run_distributed
from parity import ATOL, RTOL

WORLDS = [2, 3]
LOOPS = [c for c in cases_scaler.CASES if c.startswith("case_loop_")]
CLIPPING = ("B", "C", "D", "D0", "E", "G", "Gf")  # loops that clip, and whose norm is compared


@functools.lru_cache(maxsize=None)
def _results(world: int):
    return run_distributed(run_cases, world, "cases_scaler", cases_scaler.CASES)


def _case(world: int, case: str):
    return case_values(_results(world), case)


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("case", LOOPS)
def test_loop_matches_torch(world: int, case: str) -> None:
    check_loop_case(_results(world), case)


def check_loop_case(per_rank, case: str) -> None:
    """Same params as torch's loop every step, same scale and skipped steps on every rank,
    norms equal torch's, and the warnings each loop must (not) give; the step's health: the inf
    named where it was injected (that rank, that param), step_stats() counting the reference's
    skips (spikes apart: the scaler never backs off for one), its loss scale and last norm."""
    loop = case[len("case_loop_"):].replace("D_no_scaler", "D0")
    spike = loop.endswith("_spike")
    loop = loop[: -len("_spike")] if spike else loop
    values = case_values(per_rank, case)
    v0 = values[0]
    check_health(values, loop, spike)
    clipped = False
    for step in range(len(v0["ours"])):
        for i, (ours, ref) in enumerate(zip(v0["ours"][step], v0["ref"][step])):
            torch.testing.assert_close(ours, ref, rtol=RTOL, atol=ATOL, msg=lambda m: f"step {step} param {i}: {m}")
            assert torch.isfinite(ours).all()
        if v0["ref_scale"][step] is not None:
            assert v0["scale"][step] == v0["ref_scale"][step], f"step {step}: scale differs from torch's"
        ref_norm, norm = v0["ref_norm"][step], v0["norm"][step]
        if loop in CLIPPING and math.isfinite(ref_norm):
            assert norm is not None and math.isclose(norm, ref_norm, rel_tol=1e-4), (step, norm, ref_norm)
            clipped |= ref_norm > MAX_NORM
        if v0["skipped"][step] is not None:
            assert v0["skipped"][step] == (step == INF_STEP)
    if loop in CLIPPING:
        assert clipped, "the clip never engaged: the test would not catch a missing clip"
    # the skipped steps really were skipped (with or without a scaler): params did not move
    for step, why in enumerate(v0["ref_skip"]):
        if why is not None:
            for a, b in zip(v0["ours"][step - 1], v0["ours"][step]):
                assert torch.equal(a, b), (step, why)
    # every rank: same params, same scale
    for other in values[1:]:
        assert other["scale"] == v0["scale"]
        for s in range(len(v0["ours"])):
            for a, b in zip(v0["ours"][s], other["ours"][s]):
                assert torch.equal(a, b)
    warned = [w for w in v0["warnings"] if "clipped nothing" in w]
    assert len(warned) == (1 if loop == "F" else 0), v0["warnings"]
    if loop not in ("A", "F"):  # torch.amp.GradScaler hands itself over with a FutureWarning of its own
        assert not any("FutureWarning" in w for w in v0["warnings"]), v0["warnings"]


@pytest.mark.parametrize("world", WORLDS)
def test_one_all_reduce_per_step(world: int) -> None:
    for value in _case(world, "case_one_all_reduce"):
        for calls in value["counts"]:
            assert len(calls) == 1, calls
            # the one all-reduce carries exactly: norm partial + non-finite flag (2), a touched flag
            # per param (7 for this MLP), the step's health (1: ranks whose own grads held inf/NaN;
            # one param group, so no per-group partials: health.py) and 31 agreement floats (an
            # invalid flag, then 6 per category: hyperparameters of the one group, norm type, step
            # options, reductions since the last step, the clips of the last step: agreement.py),
            # whatever the model size; written out here, not computed by the code under test
            assert value["n_params"] == 7
            assert calls[0] == 2 + 7 + 1 + 31, calls


@pytest.mark.parametrize("world", WORLDS)
def test_norm_types_and_inf_norm_clipping(world: int) -> None:
    for value in _case(world, "case_norm_types"):
        for ours, ref in zip(value["ours"], value["ref"]):
            for a, b in zip(ours, ref):
                assert a == pytest.approx(b, rel=1e-4)
        for a, b in zip(value["params"], value["ref_params"]):
            torch.testing.assert_close(a, b, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("world", WORLDS)
def test_found_inf_is_exactly_one_when_several_ranks_overflow(world: int) -> None:
    for value in _case(world, "case_found_inf_is_exactly_one"):
        assert value == [(torch.float32, 0, 1.0)]


@pytest.mark.parametrize("world", WORLDS)
def test_foreign_optimizer_found_inf_agreed_over_ranks(world: int) -> None:
    for scales in _case(world, "case_foreign_optimizer_agrees"):
        assert scales == [2.0**10, 2.0**9, 2.0**9]  # every rank backed off at step 1


def check_health(values, loop: str, spike: bool) -> None:
    """Every rank: ``last_nonfinite()`` names exactly the rank and param the inf was injected
    into at INF_STEP (the last rank's batch reaches the first layer's weight) and nothing at
    the other steps; ``step_stats()`` counts what the reference skipped."""
    world = len(values)
    v0 = values[0]
    skips = v0["ref_skip"]
    assert skips.count("nonfinite") == 1 and skips.count("spike") == (len(SPIKE_STEPS) if spike else 0), skips
    for rank, v in enumerate(values):
        for step, named in enumerate(v["nonfinite"]):
            want = [(world - 1, v0["nonfinite_name"])] if step == INF_STEP else []
            assert [tuple(x) for x in named] == want, (rank, step, named)
        stats = v["stats"]
        assert set(stats) == {"steps", "skipped_steps", "skipped_spike", "skipped_nonfinite", "consecutive_skips",
                              "last_grad_norm", "loss_scale"}, stats
        assert stats["skipped_nonfinite"] == 1 and stats["skipped_spike"] == skips.count("spike"), stats
        assert stats["skipped_steps"] == stats["skipped_nonfinite"] + stats["skipped_spike"]
        assert stats["steps"] == len(skips) - stats["skipped_steps"], stats
        trailing = 0
        for why in reversed(skips):
            if why is None:
                break
            trailing += 1
        assert stats["consecutive_skips"] == trailing, (stats, skips)
        assert stats["loss_scale"] == v["ref_final_scale"], stats
        assert math.isclose(stats["last_grad_norm"], v["ref_unscaled"][-1], rel_tol=1e-4), (stats, v["ref_unscaled"])


@pytest.mark.parametrize("world", WORLDS)
def test_spike_steps_counted_and_not_overflows(world: int) -> None:
    """The spike cases engaged: their norms really were above the threshold at SPIKE_STEPS only,
    and the scaler did not back off at them (its scale equals torch's, which never saw them)."""
    for case in [c for c in LOOPS if c.endswith("_spike")]:
        v0 = _case(world, case)[0]
        for step, norm in enumerate(v0["ref_unscaled"]):
            assert (norm > SPIKE_ABOVE) == (step in SPIKE_STEPS), (case, step, norm)


@pytest.mark.parametrize("world", WORLDS)
def test_nonfinite_named_on_one_rank_reported_everywhere(world: int) -> None:
    """An inf in one named param's grad on one rank only (then NaN and -inf on two ranks at
    once) is reported as exactly those (rank, name) pairs on every rank; the steps are skipped
    as torch skips them (params equal unsharded AdamW's, with and without a scaler, same
    scale); step_stats() counts them; the logger names them once per skip and the scaler's
    back-offs once each."""
    import cases_scaler as cs

    values = _case(world, "case_nonfinite_named")
    for key in ("scaled=True", "scaled=False"):
        per_rank = [v[key] for v in values]
        for rank, v in enumerate(per_rank):
            for step, named in enumerate(v["named"]):
                want = sorted((r % world, n) for r, n, _ in cs.NAMED_POISON.get(step, []))
                assert [tuple(x) for x in named] == want, (key, rank, step, named)
                for i, (a, b) in enumerate(zip(v["params"][step], v["ref_params"][step])):
                    torch.testing.assert_close(a, b, rtol=RTOL, atol=ATOL, msg=lambda m: f"{key} step {step} {i}: {m}")
            assert v["scales"] == v["ref_scales"], key
            assert v["stats"]["skipped_nonfinite"] == len(cs.NAMED_POISON) and v["stats"]["skipped_spike"] == 0
            assert v["stats"]["steps"] == cs.NAMED_STEPS - len(cs.NAMED_POISON)
            warned = [m for level, m in v["log"] if level == "WARNING"]
            skips = [m for m in warned if "skipped: non-finite" in m]
            assert len(skips) == 2, warned
            assert "step 3 skipped" in skips[0] and f"rank {world - 1}: b.weight" in skips[0], skips
            assert "step 6 skipped" in skips[1] and "rank 0: head.bias; rank 1: a.weight" in skips[1], skips
            backoffs = [m for m in warned if "backed off" in m]
            assert len(backoffs) == (2 if key == "scaled=True" else 0), warned
        for other in per_rank[1:]:
            assert other["named"] == per_rank[0]["named"]


@pytest.mark.parametrize("world", WORLDS)
def test_nonfinite_only_in_the_reduction_reports_no_rank(world: int) -> None:
    """fp16 grads each finite on every rank, their sum overflowing in the reduce-scatter: the
    step is skipped and counted, but last_nonfinite() is empty (no rank's own grads held
    inf/NaN), and the logger says where it arose."""
    for v in _case(world, "case_nonfinite_in_reduction"):
        assert v["named"] == [] and not v["moved"], v
        assert v["stats"]["skipped_nonfinite"] == 1 and v["stats"]["steps"] == 0, v["stats"]
        assert any("arose in their reduction" in m for _, m in v["log"]), v["log"]


@pytest.mark.parametrize("world", WORLDS)
def test_grad_norms_by_group_match_torch(world: int) -> None:
    check_group_norms(_case(world, "case_group_norms"))


def check_group_norms(values) -> None:
    """Every rank: each group's norm equals torch's get_total_norm of that group's unsharded
    grads (before the step, unscaled; the same after it), the groups make up the whole norm."""
    for v in values:
        for step, s in enumerate(v["steps"]):
            assert len(s["before"]) == 3
            for ours, after, want in zip(s["before"], s["after"], s["want"]):
                assert ours == pytest.approx(want, rel=1e-4), (step, s)
                assert after == ours, (step, s)
            # the groups make up the whole norm (2: root of the sum of squares; inf: the max)
            whole = max(s["want"]) if step == 2 else math.sqrt(sum(w * w for w in s["want"]))
            assert s["total"] == pytest.approx(whole, rel=1e-4), (step, s)
        groups, total = v["single"]
        assert len(groups) == 1 and groups[0] == pytest.approx(total, rel=1e-6)

