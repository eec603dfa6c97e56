"""The zero-copy landing on CUDA (one process): a complete bucket's grads stay where autograd left
them; its flags' pass (``bucket_stats_parts``) and the step's update kernel read them in place,
each segment from its own grad, and the flat shard is made only when something else reads it.
Unlike the CPU's, a bucket holding inf/NaN is held too (the device flags it; the host cannot
look). Every case trains bit for bit as the copying landing (``copy_grads=True``) and as torch's
AdamW to its tolerance; the flags' pass sums exactly what it sums over the landed shard. Skipped
without a GPU (the CPU's own cases: test_zero_copy_landing.py, whose training loops these reuse)."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from shardamp.optim import DistributedFusedAdam, config, kernels
from test_zero_copy_landing import (LOOPS, _bitwise, _landed, _layout, _train, _train_subsets,
                                    check_held_as_the_copy, check_held_as_torch, check_inf_step, loop_kw)

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.fixture(autouse=True)
def _copy_grads_default():
    yield
    config.configure(copy_grads=None)


def _native():
    ext = kernels.native_module(torch.device("cuda"))
    if ext is None or not hasattr(ext, "HELD_SEGMENTS"):
        pytest.fail("the CUDA kernels are not built, or without the in-place reads")
    return ext


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("loop", LOOPS)
@pytest.mark.parametrize("buckets", ["one", "several"])
def test_held_grads_train_bitwise_as_the_copy(dtype, loop, buckets):
    """Two param groups throughout: their norms' partials read the held grads in place too."""
    check_held_as_the_copy(buckets, **loop_kw(loop, dtype=dtype, device="cuda"))


@pytest.mark.parametrize("loop", LOOPS)
def test_held_grads_train_as_torch_adamw(loop):
    check_held_as_torch(**loop_kw(loop, steps=5, device="cuda"))


@pytest.mark.parametrize("loop", ["plain", "scaler+clip"])
def test_an_inf_bucket_is_held_flagged_and_its_step_skipped(loop):
    held = check_inf_step(**loop_kw(loop, inf_at=2, steps=5, device="cuda"))
    assert all(all(h) for h in held)  # the device flags the inf: held like the others


def test_reading_param_grad_and_accumulating_train_the_same():
    for kw in (dict(read_grads=True, clip=True), dict(accumulate=3, clip=True),
               dict(set_to_none="alternate", scaled=True, clip=True, steps=6)):
        kw["device"] = "cuda"
        params, _, norms, seen = _train(False, **kw)
        copied, _, norms_copy, seen_copy = _train(True, **kw)
        ref, _, ref_norms, seen_ref = _train(False, torch_ref=True, **kw)
        _bitwise(params, copied)
        assert norms == norms_copy
        for a, b, r in zip(seen, seen_copy, seen_ref):
            assert torch.equal(a, b)
            torch.testing.assert_close(a, r, rtol=1e-5, atol=1e-6)
        for p, r in zip(params, ref):
            torch.testing.assert_close(p, r, rtol=1e-5, atol=1e-6)


def test_held_and_landed_steps_mixed_train_as_the_copy_and_torch():
    held_params, held = _train_subsets(copy=False, device="cuda")
    copy_params, copied = _train_subsets(copy=True, device="cuda")
    ref_params, _ = _train_subsets(copy=False, torch_ref=True, device="cuda")
    assert held == [step % 3 == 0 for step in range(24)], held
    assert not any(copied)
    for a, b, r in zip(held_params, copy_params, ref_params):
        assert torch.equal(a, b)
        torch.testing.assert_close(a, r, rtol=1e-5, atol=1e-6)


def test_buckets_are_cut_at_held_segments_and_every_one_is_held(monkeypatch):
    """One process cuts its buckets at ``HELD_SEGMENTS`` params (under the byte cap, once they
    hold ``HELD_CUT_BYTES``: 0 here, for tiny params), so a model with more params than that in
    one cap's worth still has every bucket held; it trains bitwise as the copying landing (the
    same layout) and as torch's AdamW. Without the patch the same tiny params keep one bucket."""
    from shardamp.optim.sync import merged_landings

    n = 2 * _native().HELD_SEGMENTS + 1
    small = [nn.Parameter(torch.randn(5, device="cuda")) for _ in range(n)]
    assert len(DistributedFusedAdam(small, lr=1e-2)._buckets) == 1  # a few KB: left whole, copied
    monkeypatch.setattr(merged_landings, "HELD_CUT_BYTES", 0)

    def run(copy: bool, torch_ref: bool = False):
        config.configure(copy_grads=copy)
        torch.manual_seed(0)
        params = [nn.Parameter(torch.randn(5, device="cuda")) for _ in range(n)]
        opt = (torch.optim.AdamW(params, lr=1e-2, weight_decay=0.0) if torch_ref
               else DistributedFusedAdam(params, lr=1e-2, weight_decay=0.0))
        held, sizes = [], None
        for step in range(3):
            opt.zero_grad()
            sum((p * p).sum() * (step + 1) for p in params).backward()
            if not torch_ref:
                held.append([b.held is not None for b in opt._buffers])
                sizes = [len(b.slots) for b in opt._buckets]
            if torch_ref:
                torch.nn.utils.clip_grad_norm_(params, 1.0)
            else:
                opt.clip_grad_norm(1.0)
            opt.step()
        return [p.detach().clone() for p in params], held, sizes

    params, held, sizes = run(False)
    copied, copied_held, copied_sizes = run(True)
    ref, _, _ = run(False, torch_ref=True)
    assert sorted(sizes) == sorted([_native().HELD_SEGMENTS] * 2 + [1]) and sizes == copied_sizes, sizes
    assert all(all(h) for h in held) and not any(map(any, copied_held)), held
    _bitwise(params, copied)
    for p, r in zip(params, ref):
        torch.testing.assert_close(p, r, rtol=1e-5, atol=1e-6)


def _past_held_segments(copy: bool, frozen: bool):
    """``HELD_SEGMENTS + 1`` params in one bucket (the caller turns the layout's cut off), the
    first frozen where ``frozen`` (a segment without a grad); three steps. Returns the params
    and whether the bucket was held after each backward."""
    n = _native().HELD_SEGMENTS + 1
    config.configure(copy_grads=copy)
    torch.manual_seed(0)
    params = [nn.Parameter(torch.randn(5, device="cuda")) for _ in range(n)]
    if frozen:
        params[0].requires_grad_(False)
    opt = DistributedFusedAdam(params, lr=1e-2, weight_decay=0.0)
    assert len(opt._buckets) == 1 and len(opt._buckets[0].slots) == n
    held = []
    for step in range(3):
        opt.zero_grad()
        sum((p * p).sum() * (step + 1) for p in params[int(frozen):]).backward()
        held.append(opt._buffers[0].held is not None)
        opt.step()
    return [p.detach().clone() for p in params], held


@pytest.mark.parametrize("frozen", [False, True])
def test_a_bucket_past_held_segments_is_copied_and_trains_the_same(monkeypatch, frozen):
    """More segments in a bucket than a launch's arguments carry (``HELD_SEGMENTS``; the layout
    does not cut here, as where a state format keeps buckets whole): its grads are copied into
    its shard, as before the zero-copy landing. ``frozen``: the bucket completes with
    ``HELD_SEGMENTS`` grads (a frozen param is a segment without one), so the per-bucket gate on
    segments, not the count of grads, keeps it from being held (the update launch needs every
    segment's address)."""
    monkeypatch.setattr(kernels, "held_bucket_params", lambda device: None)
    params, held = _past_held_segments(False, frozen)
    copied, _ = _past_held_segments(True, frozen)
    _bitwise(params, copied)
    assert not any(held)


def test_only_the_bucket_past_held_segments_is_copied(monkeypatch):
    """The gate is per bucket: beside a bucket of more than ``HELD_SEGMENTS`` segments (the
    layout not cutting it), the optimizer's other bucket is still held; both train as the
    copying landing and as torch."""
    monkeypatch.setattr(kernels, "held_bucket_params", lambda device: None)
    n = _native().HELD_SEGMENTS + 1

    def run(copy: bool, torch_ref: bool = False):
        config.configure(copy_grads=copy)
        torch.manual_seed(0)
        small = [nn.Parameter(torch.randn(5, device="cuda")) for _ in range(n)]
        big = nn.Parameter(torch.randn(1 << 19, device="cuda"))  # 2 MB: a bucket of its own at 1 MB
        params = [big, *small]
        if torch_ref:
            opt = torch.optim.AdamW(params, lr=1e-2, weight_decay=0.0)
        else:
            opt = DistributedFusedAdam(params, lr=1e-2, weight_decay=0.0, bucket_cap_mb=1)
            assert len(opt._buffers) == 2
        held = []
        for step in range(3):
            opt.zero_grad()
            sum((p * p).sum() * (step + 1) for p in params).backward()
            if not torch_ref:
                # (is the big param's bucket, is held), the small params' bucket first
                held.append(sorted((b.shard_numel >= 1 << 19, b.held is not None) for b in opt._buffers))
            opt.step()
        return [p.detach().clone() for p in params], held

    params, held = run(False)
    copied, _ = run(True)
    ref, _ = run(False, torch_ref=True)
    _bitwise(params, copied)
    for p, r in zip(params, ref):
        torch.testing.assert_close(p, r, rtol=1e-5, atol=1e-6)
    assert held == [[(False, False), (True, True)]] * 3, held


def test_held_grads_take_no_shard_memory():
    """The held bucket's shard is never allocated: the peak of a backward and step is the
    copying landing's less (about) the shard."""
    def peak(copy: bool) -> int:
        config.configure(copy_grads=copy)
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(1024, 1024), nn.Tanh(), nn.Linear(1024, 1024)).cuda()
        opt = DistributedFusedAdam(model.parameters(), lr=1e-3)
        x = torch.randn(8, 1024, device="cuda")
        for _ in range(2):
            opt.zero_grad()
            model(x).square().mean().backward()
            opt.step()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        opt.zero_grad()
        model(x).square().mean().backward()
        held = opt._buffers[0].held is not None
        opt.step()
        torch.cuda.synchronize()
        assert held == (not copy)
        return torch.cuda.max_memory_allocated() - base

    shard = sum(p.numel() for p in nn.Sequential(nn.Linear(1024, 1024), nn.Linear(1024, 1024)).parameters()) * 4
    saved = peak(True) - peak(False)
    assert saved >= 0.9 * shard, (saved, shard)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("seed", range(4))
def test_bucket_stats_over_parts_is_bitwise_the_landed_shards(dtype, seed):
    ext = _native()
    numel = 150_001 if seed % 2 else 3_001
    offsets, sizes = _layout(seed, numel)
    offsets, sizes = offsets[:ext.HELD_SEGMENTS], sizes[:ext.HELD_SEGMENTS]
    g = torch.Generator().manual_seed(100 + seed)
    grads = [(torch.randn(s, generator=g) * 3).to(dtype).cuda() for s in sizes]
    if seed >= 2:  # a non-finite value in two of the parts: their params' flags, and "any"
        grads[0][-1] = float("inf")
        grads[len(grads) // 2][0] = float("nan")
    full = _landed([x.cpu() for x in grads], offsets, numel, dtype).cuda()
    rows = torch.tensor([[o, s, i] for i, (o, s) in enumerate(zip(offsets, sizes))], dtype=torch.int64,
                        device="cuda").reshape(-1, 3)
    for assign in (True, False):
        want, got = torch.tensor([0.25, 0.0], device="cuda"), torch.tensor([0.25, 0.0], device="cuda")
        want_flags = torch.zeros(len(sizes) + 1, device="cuda")
        got_flags = torch.zeros(len(sizes) + 1, device="cuda")
        kernels.bucket_stats(full, rows, want_flags, want, assign)
        assert ext.bucket_stats_parts(grads, offsets, numel, got, assign, rows, got_flags)
        torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)
        assert torch.equal(got_flags, want_flags)
        assert bool(want_flags[-1]) == (seed >= 2)


@pytest.mark.parametrize("norm_type", [1.0, 2.0, 3.0, float("inf")])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_group_partials_over_parts_is_bitwise_the_landed_shards(norm_type, dtype):
    """Each segment read from its own grad (a frozen param's segment: no grad, partial 0), in the
    landed shard's chunks and fold order."""
    from shardamp.optim.kernels.launch_config import chunk_table
    from shardamp.optim.layout import Segment, SegmentTable

    ext = _native()
    numel = 140_000
    offsets, sizes = _layout(1, numel)
    offsets, sizes = offsets[:40], sizes[:40]
    numel = offsets[-1] + sizes[-1] + 37
    g = torch.Generator().manual_seed(7)
    grads = [torch.randn(s, generator=g).to(dtype).cuda() for s in sizes]
    segs = [Segment(o, s, i, i % 3, 0) for i, (o, s) in enumerate(zip(offsets, sizes))]
    segs.append(Segment(offsets[-1] + sizes[-1], 37, len(segs), 1, 0))  # no grad: zeros in the shard
    rows = [[s.start, s.length, s.param_index, s.group] for s in segs]
    table = SegmentTable(segs, torch.tensor(rows, dtype=torch.int64, device="cuda"))
    chunks = chunk_table(table, numel, len(segs), 3, ext.CUDA_CHUNK).cuda()
    full = _landed([x.cpu() for x in grads], offsets, numel, dtype).cuda()
    want, got = torch.full((3,), 0.5, device="cuda"), torch.full((3,), 0.5, device="cuda")
    ext.group_partials(full, table.table, want, norm_type, chunks)
    ext.group_partials_parts(grads, offsets, numel, table.table, got, norm_type, chunks, table.spans)
    assert torch.equal(got, want), (got, want)


def test_bucket_stats_over_parts_declines_under_graph_capture():
    ext = _native()
    grads = [torch.ones(8, device="cuda")]
    rows = torch.tensor([[0, 8, 0]], dtype=torch.int64, device="cuda")
    flags, out = torch.zeros(2, device="cuda"), torch.zeros(2, device="cuda")
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        torch.cuda.synchronize()
        with torch.cuda.graph(graph, stream=stream):
            declined = not ext.bucket_stats_parts(grads, [0], 8, out, True, rows, flags)
    assert declined
    assert ext.bucket_stats_parts(grads, [0], 8, out, True, rows, flags)
    assert out.tolist() == [8.0, 0.0]
