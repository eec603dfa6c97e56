"""The compiled statistics kernels (csrc/) against the reference (optim/kernels/reference.py):
grad stats, per-row non-finite flags and per-group norm partials, and the per-step scalars formed
from them (stats_finish, step_scalars with and without the health record), called directly so the
result does not depend on SHARDAMP_KERNELS. CPU cases always run; CUDA cases need a GPU."""
from __future__ import annotations

import math

import pytest
import torch

from kernel_shards import DEVICES, GRAD_DTYPES, NUMEL, ext_for
from shardamp.optim.kernels import launch_config, reference
from shardamp.optim.layout import Segment, SegmentTable


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("grad_dtype", GRAD_DTYPES)
@pytest.mark.parametrize("norm_type", [1.0, 2.0, 3.0, math.inf])
def test_grad_stats_matches_reference(device, grad_dtype, norm_type):
    ext = ext_for(device)
    g = torch.Generator().manual_seed(int(norm_type) if math.isfinite(norm_type) else 11)
    for n in (1, 7, 1000, 70001):  # shorter than a vector, a tail, and several blocks' worth
        grad = (torch.randn(n, generator=g) * 2).to(grad_dtype).to(device)
        prior = torch.tensor([0.25, 0.0], device=device)  # accumulated into, not overwritten
        ref, out = prior.clone(), prior.clone()
        reference.grad_stats(grad, ref, norm_type)
        ext.grad_stats(grad, out, norm_type)
        torch.testing.assert_close(out.cpu(), ref.cpu(), rtol=2e-5, atol=0)
        again = prior.clone()
        ext.grad_stats(grad, again, norm_type)
        assert torch.equal(again, out)  # deterministic: same bits every call
    odd = torch.randn(1001, generator=g).to(grad_dtype).to(device)[1:]  # unaligned data pointer
    ref, out = torch.zeros(2, device=device), torch.zeros(2, device=device)
    reference.grad_stats(odd, ref, norm_type)
    ext.grad_stats(odd, out, norm_type)
    torch.testing.assert_close(out.cpu(), ref.cpu(), rtol=2e-5, atol=0)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("grad_dtype", GRAD_DTYPES)
@pytest.mark.parametrize("bad", [math.inf, -math.inf, math.nan])
@pytest.mark.parametrize("norm_type", [2.0, math.inf])
def test_grad_stats_flags_non_finite(device, grad_dtype, bad, norm_type):
    ext = ext_for(device)
    grad = torch.randn(5000).to(grad_dtype).to(device)
    grad[4321] = bad
    ref, out = torch.zeros(2, device=device), torch.zeros(2, device=device)
    reference.grad_stats(grad, ref, norm_type)
    ext.grad_stats(grad, out, norm_type)
    assert out[1].item() == 1.0
    torch.testing.assert_close(out.cpu(), ref.cpu(), equal_nan=True)
    empty = torch.empty(0, dtype=grad_dtype, device=device)
    ext.grad_stats(empty, out, norm_type)  # an empty shard changes nothing
    torch.testing.assert_close(out.cpu(), ref.cpu(), equal_nan=True)


@pytest.mark.parametrize("device", DEVICES)
def test_step_scalars_match_reference_bitwise(device):
    """The grad coefficient (base * scale * clip) and the step counts in one launch: bit for bit
    the reference's torch ops, for norms below, at and above max_norm, zero, inf and NaN, with
    and without a clip and a found-inf."""
    ext = ext_for(device)
    g = torch.Generator().manual_seed(3)
    touched = (torch.rand(37, generator=g) > 0.3).float().to(device)
    for norm_value in (0.0, 0.3, 1.0, 1.0 + 1e-7, 7.5, 3e38, math.inf, math.nan):
        for clip in (True, False):
            for found in (0.0, 1.0):
                for base_value, scale in ((1 / 65536, 1.0), (1 / 65536, 0.25), (0.5, 1.0 / 3.0)):
                    base = torch.tensor(base_value, device=device)
                    norm = torch.tensor(norm_value, device=device) if clip else None
                    found_inf = torch.tensor(found, device=device)
                    steps = torch.arange(37, dtype=torch.float32, device=device)
                    outs = []
                    for fn in (ext.step_scalars, reference.step_scalars):
                        coef, s = torch.empty((), device=device), steps.clone()
                        fn(coef, base, scale, norm, 0.7, found_inf, s, touched)
                        outs.append((coef, s))
                    (c_n, s_n), (c_r, s_r) = outs
                    assert torch.equal(s_n, s_r)
                    assert (math.isnan(c_r.item()) and math.isnan(c_n.item())) or c_n.item() == c_r.item(), \
                        (norm_value, clip, base_value, scale, c_n.item(), c_r.item())
                    assert 0.0 <= c_n.item() <= base_value * scale * (1 + 1e-6)


@pytest.mark.parametrize("device", DEVICES)
def test_stats_finish_matches_reference_bitwise(device):
    """The reduced stats' norm, found-inf and 0/1 touched flags in one launch: bit for bit the
    reference's four torch ops (the norm: the correctly rounded root), for norm types 2 and inf, finite, zero, inf and NaN partials,
    the flag set or not, touched counts above 1 (SUM over ranks) and a NaN one, the tail beyond ``end`` left
    alone, and more touched entries than one block of threads covers."""
    ext = ext_for(device)
    g = torch.Generator().manual_seed(5)
    for n_touched in (0, 3, 161, 70000):
        counts = torch.randint(0, 4, (n_touched,), generator=g).float()
        if n_touched:
            counts[n_touched // 2] = math.nan  # kept NaN, as torch's clamp keeps it
        tail = torch.randn(9, generator=g)
        for norm_type in (2.0, math.inf):
            for partial in (0.0, 2.25, 3e38, math.inf, math.nan):
                for flag in (0.0, 1.0, 3.0):
                    stats = torch.cat([torch.tensor([partial, flag]), counts, tail]).to(device)
                    end = 2 + n_touched
                    native, ref = stats.clone(), stats.clone()
                    views = [(0, 2), (end, stats.numel() - end)]
                    out0, out1, head, rest = ext.stats_finish(native, end, norm_type, views)
                    out = torch.stack([out0, out1])
                    raw, found = reference.stats_finish(ref, end, norm_type)
                    # the views asked for are views of the stats, made in the same call
                    assert head.data_ptr() == native.data_ptr() and rest.data_ptr() == native[end:].data_ptr()
                    assert head.shape == (2,) and rest.shape == (stats.numel() - end,)
                    assert out0.dim() == 0 and out0.data_ptr() + 4 == out1.data_ptr()
                    torch.testing.assert_close(native[2:], ref[2:], rtol=0, atol=0, equal_nan=True)
                    torch.testing.assert_close(native[:2], stats[:2], rtol=0, atol=0, equal_nan=True)  # header read only
                    # the norm is the correctly rounded root: torch's CPU sqrt is 1 ulp off for some
                    # inputs (3e38), its CUDA sqrt is IEEE; the float64 root rounded once is exact
                    exact = torch.tensor(partial, dtype=torch.float32).double()
                    exact = (exact.sqrt() if norm_type == 2.0 else exact).float()
                    torch.testing.assert_close(raw.cpu(), exact, rtol=1.2e-7, atol=0, equal_nan=True)
                    for got, want in ((out[0], exact), (out[1], found)):
                        assert (math.isnan(want.item()) and math.isnan(got.item())) or got.item() == want.item(), \
                            (norm_type, partial, flag, got.item(), want.item())
                    assert found.item() == (1.0 if flag or not math.isfinite(partial) else 0.0)
                    flags = native[2:end]
                    assert bool(((flags <= 1.0) | flags.isnan()).all()) and int(flags.isnan().sum()) == min(n_touched, 1)


@pytest.mark.parametrize("device", DEVICES)
def test_stats_finish_views_alias_the_stats_without_autograd_views(device):
    """The finish's results are aliases of the stats' (and the header's) storage made without the
    dispatcher (no autograd view bookkeeping: a step makes 4-6 right after a backward, when each
    view costs the host microseconds): they read what the storage holds, writes through either
    side show in the other, they require no grad; a caller's stats that require grad still get
    autograd's views."""
    ext = ext_for(device)
    stats = torch.tensor([4.0, 0.0, 2.0, 1.0, 7.0, 5.0], device=device)
    norm, found, touched, tail = ext.stats_finish(stats, 4, 2.0, [(2, 2), (4, 2)])
    assert norm.dim() == 0 and found.dim() == 0 and touched.shape == (2,) and tail.shape == (2,)
    assert (norm.item(), found.item(), touched.tolist(), tail.tolist()) == (2.0, 0.0, [1.0, 1.0], [7.0, 5.0])
    for t in (touched, tail):
        assert t.untyped_storage().data_ptr() == stats.untyped_storage().data_ptr()
        assert t._base is None and not t.requires_grad and t.device == stats.device
    assert norm.untyped_storage().data_ptr() == found.untyped_storage().data_ptr()
    assert found.data_ptr() == norm.data_ptr() + 4
    stats[5] = 9.0
    tail[0] = 3.0
    assert tail.tolist() == [3.0, 9.0] and stats[4].item() == 3.0
    leaf = torch.tensor([4.0, 0.0, 2.0, 1.0], device=device, requires_grad=True)
    with torch.no_grad():
        base = leaf * 1.0  # a stats buffer that requires grad
    base.requires_grad_()
    _, _, flags = ext.stats_finish(base, 4, 2.0, [(2, 2)])
    assert flags._base is not None and flags.tolist() == [1.0, 1.0]


@pytest.mark.parametrize("device", DEVICES)
def test_step_scalars_health_match_reference_bitwise(device):
    """The step's health in the same launch: the skip (found-inf, or the unscaled norm ``raw *
    avg * inv_scale`` above ``skip_above``, never for NaN), the steps advanced by it, the fp64
    counters and the record [reason, unscaled norm], or the whole report [reason, unscaled
    norm, ranks (0 if not given), inverse scale (1 without)]: bit for bit the reference's torch
    ops, for norms below, at and above the threshold, inf and NaN, with and without a scale; the
    record's host copy (``record_host``) equals it, pinned or not; the spare flags (``spare``, of
    any size: the block's threads stride over it) end all zero."""
    ext = ext_for(device)
    touched = torch.tensor([1.0, 0.0, 1.0, 1.0], device=device)
    cases = [(raw, found, inv, above, 2, None) for raw in (0.0, 0.5, 2.0, 2.0 + 1e-6, 3e38, math.inf, math.nan)
             for found in (0.0, 1.0) for inv in (None, 0.25, 1.0) for above in (math.inf, 1.0, 0.5)]
    cases += [(raw, found, inv, 1.0, 4, ranks) for raw in (0.5, 3.0, math.nan) for found in (0.0, 1.0)
              for inv in (None, 0.25) for ranks in (None, 0.0, 2.0)]
    for n_case, (raw_value, found, inv, above, record_len, ranks) in enumerate(cases):
        outs = []
        for fn in (ext.step_scalars, reference.step_scalars):
            # where the host reads the record: on CUDA page-locked memory (the kernel writes it through
            # its mapped address) or, every third case, pageable memory (copied after the launch)
            pinned = device == "cuda" and n_case % 3 != 0
            host = torch.full((record_len,), -5.0, pin_memory=pinned)
            coef, steps = torch.empty((), device=device), torch.arange(4.0, device=device)
            counters = torch.tensor([5.0, 1.0, 2.0, 3.0], dtype=torch.float64, device=device)
            spare = None if n_case % 3 == 2 else torch.full((1 + 517 * (n_case % 3),), 7.0, device=device)
            health = dict(skip_out=torch.full((), -1.0, device=device),
                          raw_norm=torch.tensor(raw_value, device=device),
                          inv_scale=None if inv is None else torch.tensor(inv, device=device),
                          avg=0.5, skip_above=above, counters=counters,
                          record=torch.full((record_len,), -1.0, device=device),
                          ranks=None if ranks is None else torch.tensor([ranks], device=device),
                          record_host=host, spare=spare)
            fn(coef, torch.tensor(1.0, device=device), 1.0, None, 0.0,
               torch.tensor(found, device=device), steps, touched, **health)
            if device == "cuda":
                torch.cuda.synchronize()
            torch.testing.assert_close(host, health["record"].cpu(), rtol=0, atol=0, equal_nan=True)
            if spare is not None:
                assert spare.eq(0).all(), (fn, spare)
            outs.append((steps, health["skip_out"], counters, health["record"]))
        where = (raw_value, found, inv, above)
        for a, b in zip(*outs):
            torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True, msg=lambda m: f"{where}: {m}")
        steps, skip, counters, record = outs[0]
        unscaled = raw_value * 0.5 * (1.0 if inv is None else inv)
        want_skip = found != 0 or unscaled > above
        assert skip.item() == float(want_skip), where
        assert counters.tolist() == [5.0 + (not want_skip), 1.0 + found, 2.0 + (want_skip and not found),
                                     3.0 + 1 if want_skip else 0.0], where
        assert record[0].item() == (1.0 if found else 2.0 if want_skip else 0.0), where
        if record_len == 4:
            assert record[2:].tolist() == [ranks or 0.0, 1.0 if inv is None else inv], where


def _flag_rows(device):
    # (start, length, index): padding between rows, rows of one element, a row over several chunks
    return torch.tensor([[0, 37, 0], [48, 16400, 3], [16453, 5, 1], [16464, 1, 4], [16480, 150000, 2]],
                        dtype=torch.int64, device=device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", GRAD_DTYPES)
def test_nonfinite_flags_match_reference(device, dtype):
    """Per-row non-finite flags of a flat buffer: inf, -inf and NaN in any row (first, last and
    middle elements, a one-element row, a row spanning chunks) set exactly that row's index and
    the "any" flag; padding between rows is never looked at; flags already set stay set."""
    ext = ext_for(device)
    rows = _flag_rows(device)
    numel = 16480 + 150000 + 7
    g = torch.Generator().manual_seed(11)
    cases = [[], [(0, math.inf)], [(36, -math.inf)], [(40, math.nan)], [(16464, math.nan)],
             [(48 + 16399, math.inf), (16480 + 149999, math.nan)], [(16480 + 70000, -math.inf), (16455, math.inf)],
             [(numel - 1, math.nan)]]
    for poison in cases:
        full = (torch.randn(numel, generator=g) * 100).to(dtype).to(device)
        for at, value in poison:
            full[at] = value
        for preset in (False, True):
            outs = []
            for fn in (ext.nonfinite_flags, reference.nonfinite_flags):
                flags = torch.zeros(6, device=device)
                if preset:
                    flags[0] = 1.0
                fn(full, rows, flags)
                outs.append(flags.cpu())
            assert torch.equal(outs[0], outs[1]), (poison, preset, outs)
            hit = {r[2] for r in rows.tolist() for at, _ in poison if r[0] <= at < r[0] + r[1]}
            want = torch.zeros(6)
            for i in hit | ({0} if preset else set()):
                want[i] = 1.0
            if hit:
                want[-1] = 1.0
            assert torch.equal(outs[0], want), (poison, preset, outs[0])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", GRAD_DTYPES)
def test_bucket_stats_is_flags_and_l2_partial(device, dtype):
    """One pass over a landed bucket: its per-row flags exactly as ``nonfinite_flags`` sets them,
    and its L2 partial exactly (bitwise) as ``grad_stats`` with norm 2 accumulates it; ``assign``
    replaces ``out``'s old values (garbage and a set flag included), otherwise they are added to;
    the reference agrees to fp32 round-off."""
    ext = ext_for(device)
    rows = _flag_rows(device)
    numel = 16480 + 150000 + 7
    g = torch.Generator().manual_seed(5)
    for poison in ([], [(40, math.nan)], [(16480 + 149999, math.inf), (16455, -math.inf)], [(numel - 1, math.nan)]):
        full = (torch.randn(numel, generator=g) * 10).to(dtype).to(device)
        for at, value in poison:
            full[at] = value
        for assign in (True, False):
            start = torch.tensor([123.0, 1.0 if assign else 0.0], device=device)
            got_flags, got = torch.zeros(6, device=device), start.clone()
            got_flags[0] = 1.0  # set by an earlier bucket: stays set
            ext.bucket_stats(full, rows, got_flags, got, assign)
            want_flags, want = got_flags.new_zeros(6), (torch.zeros(2, device=device) if assign else start.clone())
            want_flags[0] = 1.0
            ext.nonfinite_flags(full, rows, want_flags)
            ext.grad_stats(full, want, 2.0)
            assert torch.equal(got_flags.cpu(), want_flags.cpu()), (poison, assign)
            torch.testing.assert_close(got.cpu(), want.cpu(), rtol=0.0, atol=0.0, equal_nan=True)
            ref_flags, ref = torch.zeros(6, device=device), start.clone()
            ref_flags[0] = 1.0
            reference.bucket_stats(full, rows, ref_flags, ref, assign)
            assert torch.equal(ref_flags.cpu(), want_flags.cpu())
            if poison:
                assert math.isnan(got[0].item()) or math.isinf(got[0].item())
                assert got[1].item() == 1.0
            else:
                assert got[1].item() == 0.0
                torch.testing.assert_close(got, ref, rtol=1e-5, atol=0.0)
    empty = torch.zeros(0, dtype=dtype, device=device)
    out = torch.tensor([7.0, 1.0], device=device)
    ext.bucket_stats(empty, rows[:0], torch.zeros(6, device=device), out, True)
    assert out.tolist() == [0.0, 0.0]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", GRAD_DTYPES)
@pytest.mark.parametrize("norm_type", [2.0, 1.0, 3.0, math.inf])
def test_group_partials_match_reference(device, dtype, norm_type):
    """Each param group's partial of a shard (its segments in several groups, interleaved, one
    over several chunks), accumulated into ``out``: the reference's to fp32 round-off; a NaN
    propagates into its group only."""
    ext = ext_for(device)
    table = SegmentTable.build([Segment(s, n, p, grp, 0) for s, n, p, grp in
                                [(0, 37, 0, 0), (48, 16400, 1, 2), (16453, 5, 2, 0), (16464, 1000, 3, 1),
                                 (17470, 40000, 5, 2)]], torch.device(device))
    g = torch.Generator().manual_seed(2)
    grad = (torch.randn(NUMEL, generator=g) * 3).to(dtype).to(device)
    for poison in (False, True):
        if poison:
            grad[16455] = math.nan  # group 0
        outs = []
        for native in (True, False):
            out = torch.tensor([0.5, 0.25, 0.0, 7.0], device=device)  # accumulated into; group 3 has no segment
            if native:  # the compiled kernel itself, whatever SHARDAMP_KERNELS says (not the dispatcher)
                chunks = None
                if device == "cuda":
                    chunks = launch_config.chunk_table(table, grad.numel(), 6, out.numel(), ext.CUDA_CHUNK).to(device)
                ext.group_partials(grad, table.table, out, float(norm_type), chunks)
            else:
                reference.group_partials(grad, table.table.cpu(), out, norm_type)
            outs.append(out.cpu())
        torch.testing.assert_close(outs[0], outs[1], rtol=2e-5, atol=0, equal_nan=True)
        assert outs[0][3] == 7.0 and bool(outs[0][0].isnan()) == poison and bool(torch.isfinite(outs[0][1:]).all())
