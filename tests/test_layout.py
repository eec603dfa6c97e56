"""Who owns which slice: for random models, every rank's shard segments cover every param
exactly once, shards are aligned and equal, and params are laid out in their memory order."""
from __future__ import annotations

import random

import pytest
import torch

from shardamp.optim.shards.buffers import param_view
from shardamp.optim.layout import ALIGN, build_layout


def _random_params(rng: random.Random):
    params = []
    for _ in range(rng.randint(1, 12)):
        kind = rng.choice(["vec", "mat", "conv", "conv3d", "scalar"])
        if kind == "vec":
            t = torch.randn(rng.randint(1, 300))
        elif kind == "mat":
            t = torch.randn(rng.randint(1, 40), rng.randint(1, 40))
            if rng.random() < 0.3:
                t = t.t()  # dense, transposed memory order
        elif kind == "conv":
            t = torch.randn(rng.randint(1, 8), rng.randint(1, 6), 3, 3).contiguous(memory_format=torch.channels_last)
        elif kind == "conv3d":
            t = torch.randn(2, rng.randint(1, 5), 2, 3, 3).contiguous(memory_format=torch.channels_last_3d)
        else:
            t = torch.randn(())
        params.append((t, rng.randint(0, 2)))
    return params


@pytest.mark.parametrize("seed", range(40))
def test_shards_partition_every_param_exactly_once(seed: int) -> None:
    rng = random.Random(seed)
    params = _random_params(rng)
    world = rng.randint(1, 5)
    cap = rng.choice([0.0001, 0.001, 0.01, 100.0])
    layouts = [build_layout(params, cap, world, rank) for rank in range(world)]
    covered = [torch.zeros(p.numel(), dtype=torch.int32) for p, _ in params]
    for rank, buckets in enumerate(layouts):
        for bucket in buckets:
            assert bucket.numel == bucket.shard_numel * world
            assert bucket.shard_numel % ALIGN == 0 and bucket.shard_start == rank * bucket.shard_numel
            for slot in bucket.slots:
                assert slot.offset % ALIGN == 0
            for seg in bucket.segments.segments:
                assert 0 <= seg.start and seg.start + seg.length <= bucket.shard_numel
                assert seg.group == params[seg.param_index][1]
                covered[seg.param_index][seg.param_offset: seg.param_offset + seg.length] += 1
            table = bucket.segments.table
            assert table.shape == (len(bucket.segments.segments), 4)
    for i, c in enumerate(covered):
        assert torch.all(c == 1), f"param {i} is not covered exactly once: {c.tolist()}"
    # identical on every rank but for the shard: what makes the fixed collective order possible
    for buckets in layouts[1:]:
        assert [[s.index for s in b.slots] for b in buckets] == [[s.index for s in b.slots] for b in layouts[0]]


@pytest.mark.parametrize("seed", range(10))
def test_params_lie_in_memory_order(seed: int) -> None:
    """A param copied into its bucket through param_view occupies [offset, offset + numel) of the
    flat buffer exactly in its own memory order (no .view(-1) of a non-contiguous tensor)."""
    rng = random.Random(100 + seed)
    params = _random_params(rng)
    (bucket, *_rest) = build_layout(params, 100.0, 1, 0)
    flat = torch.full((bucket.numel,), float("nan"))
    for slot in bucket.slots:
        p = params[slot.index][0]
        view = param_view(flat, slot)
        view.copy_(p)
        assert view.stride() == p.stride()
        memory_order = p.as_strided((p.numel(),), (1,), p.storage_offset()) if p.numel() else p.reshape(-1)
        assert torch.equal(flat[slot.offset: slot.offset + slot.numel], memory_order)


@pytest.mark.parametrize("seed", range(20))
def test_bucket_plan_is_the_policy_pack_the_layout(seed: int) -> None:
    """plan_buckets: every param once, in backward order, one dtype per bucket, under the cap
    unless alone; build_layout is exactly pack(plan_buckets(...)); the step order is the reverse."""
    from shardamp.optim.layout import backward_order, forward_order, pack, plan_buckets

    rng = random.Random(200 + seed)
    params = _random_params(rng)
    if rng.random() < 0.5:  # a second dtype: its params get buckets of their own
        params = [(p.double(), g) if rng.random() < 0.5 else (p, g) for p, g in params]
    cap = rng.choice([0.0001, 0.001, 0.01, 100.0])
    max_params = rng.choice([None, 1, 2, 3])
    cut_bytes = rng.choice([0, 0, 64, 4096])
    plan = plan_buckets(params, cap, max_params, cut_bytes)
    flat = [i for bucket in plan for i in bucket]
    assert sorted(flat) == list(range(len(params)))
    for bucket in plan:
        assert bucket == sorted(bucket, reverse=True)  # backward order inside a bucket
        assert len({params[i][0].dtype for i in bucket}) == 1
        nbytes = sum(params[i][0].numel() * params[i][0].element_size() for i in bucket)
        assert len(bucket) == 1 or nbytes <= max(int(cap * 2**20), 1)
        if max_params is not None and len(bucket) > max_params:  # left whole: too few bytes to cut
            first = bucket[:max_params]
            assert sum(params[i][0].numel() * params[i][0].element_size() for i in first) < cut_bytes
    if max_params is None:
        assert plan == plan_buckets(params, cap, len(params))  # a bound no bucket reaches cuts nothing
    else:  # the bound only adds cuts: per dtype the same params in the same order, in as many buckets or more
        free = plan_buckets(params, cap)
        for dtype in {p.dtype for p, _ in params}:
            def of(plan_):
                return [b for b in plan_ if params[b[0]][0].dtype == dtype]
            assert sum(of(plan), []) == sum(of(free), [])
            at_least = -(-len(sum(of(free), [])) // max_params) if cut_bytes == 0 else 0
            assert len(of(plan)) >= max(len(of(free)), at_least)
    with pytest.raises(ValueError, match="max_params"):
        plan_buckets(params, cap, 0)
    for world in (1, 3):
        a = build_layout(params, cap, world, world - 1, max_params=max_params, cut_bytes=cut_bytes)
        b = pack(plan, params, world, world - 1)
        assert [[(s.index, s.offset) for s in x.slots] for x in a] == [[(s.index, s.offset) for s in x.slots] for x in b]
        assert [x.shard_numel for x in a] == [x.shard_numel for x in b]
    assert list(forward_order(len(plan))) == list(reversed(backward_order(len(plan))))
    if len(plan) > 1 and len({p.dtype for p, _ in params}) == 1:  # the last bucket holds the first params
        assert min(plan[-1]) == 0 and max(plan[0]) == len(params) - 1


@pytest.mark.parametrize("seed", range(20))
@pytest.mark.parametrize("block", [128, 256])
def test_blockwise_shards_fall_on_the_block_grid_at_every_world_size(seed: int, block: int) -> None:
    """With a blockwise moment format every shard is whole blocks of the bucket's grid (no block
    straddles two ranks), and the params' offsets are those of the plain layout at every world
    size: a block holds the same bucket elements at world 1, 2 and 4."""
    rng = random.Random(seed)
    params = _random_params(rng)
    cap = rng.choice([0.0001, 0.001, 100.0])
    plain = build_layout(params, cap, 1, 0)
    used = [max(s.offset + s.numel for s in b.slots) for b in plain]
    for world in (1, 2, 3, 4):
        for rank in range(world):
            buckets = build_layout(params, cap, world, rank, block)
            assert [[(s.index, s.offset) for s in b.slots] for b in buckets] == \
                [[(s.index, s.offset) for s in b.slots] for b in plain]
            for b, end in zip(buckets, used):
                assert b.shard_numel % block == 0 and b.shard_start == rank * b.shard_numel
                assert b.numel == b.shard_numel * world and b.numel >= end
                assert b.numel - end < block * world + ALIGN  # the padding: at most whole blocks per rank


def test_block_must_be_a_multiple_of_align() -> None:
    params = [(torch.randn(10), 0)]
    with pytest.raises(ValueError, match="block=24: expected a positive multiple of ALIGN"):
        build_layout(params, 100.0, 1, 0, 24)
