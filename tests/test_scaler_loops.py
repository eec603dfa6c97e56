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
from parity import ATOL, RTOL, close_up_to_code_flips

WORLDS = [2, 3]
LOOPS = [c for c in cases_scaler.CASES if c.startswith("case_loop_")]
CLIPPING = ("B", "C", "D", "D0", "E", "F", "G", "Gf", "H", "H0", "I")  # loops that clip, and whose norm is compared


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
    lowbit = loop.endswith("_lowbit")  # against the quantized math
    loop = loop[: -len("_lowbit")] if lowbit else loop
    values = case_values(per_rank, case)
    v0 = values[0]
    check_health(values, loop, spike)
    clipped = False
    for step in range(len(v0["ours"])):
        for i, (ours, ref) in enumerate(zip(v0["ours"][step], v0["ref"][step])):
            if lowbit:
                close_up_to_code_flips(ours, ref, f"step {step} param {i}", steps=step + 1)
            else:
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
    # torch's clip_grad_norm_ after torch's unscale_ (F, I) sees the grads: nothing to warn about
    assert not [w for w in v0["warnings"] if "clipped nothing" in w], v0["warnings"]
    if loop not in ("A", "F", "I"):  # torch.amp.GradScaler hands itself over with a FutureWarning of its own
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
            assert "step 7 skipped" in skips[1] and "rank 0: head.bias; rank 1: a.weight" in skips[1], skips
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


@pytest.mark.parametrize("world", WORLDS)
def test_one_all_reduce_per_step_with_torchs_clip(world: int) -> None:
    """torch.amp.GradScaler.unscale_ + torch's clip_grad_norm_ (F), or get_total_norm +
    clip_grads_with_norm_ (I), over a DistributedFusedAdam's params: still the one stats all-reduce."""
    for value in _case(world, "case_one_all_reduce_torch_clip"):
        assert sorted(value) == ["F", "I"]
        for loop, counts in value.items():
            assert len(counts) == 3
            for calls in counts:
                assert calls == [2 + 7 + 1 + 31], (loop, calls)  # the stats all-reduce (see above), nothing else


READS = ["case_grad_reads_fp32", "case_grad_reads_sharded_scaler", "case_grad_reads_torch_scaler"]


def _close(a, b, scale: float = 1.0, msg: str = "") -> None:
    torch.testing.assert_close(a, b, rtol=RTOL, atol=ATOL * scale, msg=lambda m: f"{msg}: {m}")


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("case", READS)
def test_grad_reads_match_torch(world: int, case: str) -> None:
    """p.grad, torch's clip_grad_norm_ / get_total_norm, Lightning's grad_norm, full_grad and
    local_grad against what torch's unsharded loop holds at the same point (grad_reads.py):
    channels_last ConvNet, two param groups, uneven shards, an inf on one rank."""
    from grad_reads import INF_STEP as POISONED, MAX_NORM as CLIP, SCALER_KW

    values = _case(world, case)
    v0 = values[0]
    assert v0["channels_last"] and all(v0["channels_last"])
    scale = SCALER_KW["init_scale"] if "fp32" not in case else 1.0
    clipped = split = False
    for step, rec in enumerate(v0["steps"]):
        tag = f"step {step}"
        assert all(name == "ShardedGrad" for name, *_ in rec["views"]), rec["views"]
        for (_, shape, stride, dtype), ref in zip(rec["views"], rec["ref_grads"]):
            assert (shape, stride, dtype) == (tuple(ref.shape), ref.stride(), ref.dtype)
        # the grads as torch holds them: scaled before unscale_, unscaled after, clipped after the clip
        for ours_key, ref_key, s in (("scaled", "ref_scaled", scale), ("grads", "ref_grads", 1.0),
                                     ("clipped", "ref_clipped", 1.0), ("after_step", "ref_clipped", 1.0)):
            for i, (a, b) in enumerate(zip(rec[ours_key], rec[ref_key])):
                assert a.stride() == b.stride(), (tag, ours_key, i)  # memory order: channels_last kept
                if step != POISONED:
                    _close(a, b, s, f"{tag} {ours_key} param {i}")
                elif ours_key in ("scaled", "grads"):
                    assert not torch.isfinite(a).all() and not torch.isfinite(b).all()
        for key in ("norm", "total"):
            ours, ref = rec[key], rec[f"ref_{key}"]
            if step == POISONED:
                assert not math.isfinite(ours) and not math.isfinite(ref)
            else:
                assert math.isclose(ours, ref, rel_tol=1e-4), (tag, key, ours, ref)
        clipped |= step != POISONED and rec["ref_norm"] > CLIP
        if rec["lightning"] is not None:  # lightning installed
            assert sorted(rec["lightning"]) == sorted(rec["ref_lightning"]) and len(rec["lightning"]) == 7
            for k, ref in rec["ref_lightning"].items():
                if step != POISONED:
                    assert math.isclose(rec["lightning"][k], ref, rel_tol=1e-4), (tag, k, rec["lightning"][k], ref)
        assert all(rec["after_zero"]), rec["after_zero"]  # p.grad and full_grad None after zero_grad
        for i, (a, b) in enumerate(zip(rec["params"], rec["ref_params"])):
            _close(a, b, 1.0, f"{tag} param {i}")
        # local_grad: each rank's slice of full_grad in memory order; together they tile it once
        for key, full_key in (("local_scaled", "scaled"), ("local_clipped", "clipped")):
            for i, numel in enumerate(v0["numel"]):
                covered = torch.zeros(numel, dtype=torch.int64)
                holders = 0
                for value in values:
                    local = value["steps"][step][key][i]
                    if local is None:
                        continue
                    tensor, start, end = local
                    holders += 1
                    covered[start:end] += 1
                    flat = value["steps"][step][full_key][i]
                    flat = flat.as_strided((flat.numel(),), (1,), flat.storage_offset())
                    torch.testing.assert_close(tensor, flat[start:end], rtol=0, atol=0, equal_nan=True)
                assert bool((covered == 1).all()), (tag, key, i)
                split |= holders > 1
        for other in values[1:]:  # every rank gets the same full grads
            for a, b in zip(rec["clipped"], other["steps"][step]["clipped"]):
                torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)
    assert clipped, "the clip never engaged: the test would not catch a missing clip"
    assert split, "no param was split across ranks: the test would not catch a bad assembly"
    # the poisoned step was skipped (params did not move)
    for a, b in zip(v0["steps"][POISONED - 1]["params"], v0["steps"][POISONED]["params"]):
        assert torch.equal(a, b)
    # the model cast after a step, its grads held (a Trainer's teardown): grads and params follow, as torch's
    for value in values:
        moved = value["moved"]
        assert all(t == ("Tensor", torch.float64, torch.float64) for t in moved["types"]), moved["types"]
        for i, (a, b) in enumerate(zip(moved["grads"], moved["ref_grads"])):
            assert a.stride() == b.stride(), i
            _close(a, b, 1.0, f"moved grad {i}")
        for i, (a, b) in enumerate(zip(moved["params"], moved["ref_params"])):
            _close(a, b, 1.0, f"moved param {i}")
        assert "no longer lives in the optimizer's flat buffer" in moved["step_after"], moved["step_after"]
        assert all(moved["after_zero"]), moved["after_zero"]  # zero_grad drops what they took along
