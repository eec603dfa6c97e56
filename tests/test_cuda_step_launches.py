"""The CUDA kernels one step launches, by name (torch.profiler). On a host-bound model each launch
right after a backward costs the host ~10 us, so the plain step's are pinned: its stats' finish,
its scalars and its records are ONE launch (``stats_step_head_kernel``, fused_step.cpp's
``stats_step``), then each bucket's update. Results: test_fused_step.py compares that
path with the separate launches bit for bit. Skipped without a GPU."""
from __future__ import annotations

from collections import Counter

import pytest
import torch
import torch.nn as nn

from shardamp.optim import DistributedFusedAdam, kernels

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

NAMES = ("stats_step_head_kernel", "stats_gather_finish_kernel", "stats_finish_kernel", "step_scalars_kernel",
         "prepare_kernel")


def _step_kernels(groups: int, clip: bool) -> tuple:
    """(kernel counts of one step by the names above plus ``adam`` for the update kernels, buckets)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 4)).cuda()
    params = ([{"params": model[0].parameters()}, {"params": [*model[2].parameters(), *model[4].parameters()]}]
              if groups == 2 else model.parameters())
    opt = DistributedFusedAdam(params, lr=1e-3, bucket_cap_mb=0.02)
    x = torch.randn(8, 64, device="cuda")

    def backward() -> None:
        opt.zero_grad()
        model(x).square().mean().backward()
        if clip:
            opt.clip_grad_norm(1.0)

    return _counted_step(opt, backward), len(opt._buckets)


def _counted_step(opt: DistributedFusedAdam, backward) -> Counter:
    """The kernels of one ``opt.step()`` after ``backward()``, three steps in."""
    for _ in range(3):
        backward()
        opt.step()
    backward()
    torch.cuda.synchronize()
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts) as prof:
        opt.step()
        torch.cuda.synchronize()
    counts: Counter = Counter()
    for evt in prof.events():
        if evt.device_type != torch.autograd.DeviceType.CUDA:
            continue
        hit = next((n for n in NAMES if n in evt.name), None)
        if hit is not None:
            counts[hit] += 1
        elif "adam_kernel" in evt.name:
            counts["adam"] += 1
    return counts


@pytest.mark.skipif(kernels.backend(torch.device("cuda")) != "native", reason="needs the CUDA kernels")
@pytest.mark.parametrize("groups", [1, 2])
def test_unclipped_step_finishes_its_stats_scalars_and_records_in_one_launch(groups: int) -> None:
    counts, buckets = _step_kernels(groups, clip=False)
    assert buckets >= 2  # a launch per bucket is told apart from one per step
    assert counts["stats_step_head_kernel"] == 1, counts
    assert counts["stats_gather_finish_kernel"] == counts["stats_finish_kernel"] == counts["step_scalars_kernel"] == 0
    assert counts["prepare_kernel"] == 0, counts
    assert counts["adam"] == buckets, counts


@pytest.mark.skipif(kernels.backend(torch.device("cuda")) != "native", reason="needs the CUDA kernels")
def test_clipped_step_launches_its_scalars_alone() -> None:
    # the clip's norm was handed out before the step: its stats were finished then, the step's
    # own launches are the scalars, the prepare and each bucket's update
    counts, buckets = _step_kernels(1, clip=True)
    assert counts["stats_step_head_kernel"] == 0 and counts["stats_gather_finish_kernel"] == 0, counts
    assert counts["step_scalars_kernel"] == counts["prepare_kernel"] == 1, counts
    assert counts["adam"] == buckets, counts


@pytest.mark.skipif(kernels.backend(torch.device("cuda")) != "native", reason="needs the CUDA kernels")
def test_more_records_than_the_head_forms_take_the_prepare_launch() -> None:
    # 2,100 params, a segment each: past the 2,048 records the head's one block forms, so the
    # prepare kernel forms them (over the GPU) between the head and the updates
    torch.manual_seed(0)
    params = [nn.Parameter(torch.randn(4, device="cuda")) for _ in range(2100)]
    opt = DistributedFusedAdam(params, lr=1e-3)
    x = torch.randn(4, device="cuda")

    def backward() -> None:
        opt.zero_grad()
        torch.stack([(p * x).sum() for p in params]).square().mean().backward()

    counts = _counted_step(opt, backward)
    assert counts["stats_step_head_kernel"] == 1 and counts["prepare_kernel"] == 1, counts
    assert counts["adam"] == len(opt._buckets), counts
