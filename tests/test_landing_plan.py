"""The landing plan set at ``zero_grad`` (one process, native stager): the next backward's first
grad is staged in the grad hook, which calls no Python but queues the backward's end; its
complete buckets land in the hook. Whatever calls Python before that backward, or changes what it
must do, undoes the plan; training equals torch's AdamW in every case."""
from __future__ import annotations

from typing import List

import pytest
import torch
import torch.nn as nn

from kernel_shards import DEVICES
from shardamp.optim import DistributedFusedAdam, kernels
from shardamp.optim.sync import grad_stager
from shardamp.optim.sync.grad_sync import GradSync

native = pytest.mark.skipif(kernels.backend(torch.device("cpu")) != "native", reason="needs the compiled kernels")
devices = pytest.mark.parametrize("device", DEVICES)
SLOW, COMPLETE = grad_stager.SLOW, grad_stager.COMPLETE


def _pair(device: str, **kw):
    """A three-layer MLP whose buckets complete in launch order, with DistributedFusedAdam (small
    buckets: several), and the same model with torch's AdamW."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 2)).to(device)
    ref = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 2)).to(device)
    ref.load_state_dict(model.state_dict())
    opt = DistributedFusedAdam(model.parameters(), lr=1e-2, weight_decay=0.02, bucket_cap_mb=0.0005, **kw)
    torch_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.02)
    assert len(opt._buckets) >= 3
    return model, ref, opt, torch_opt


def _events(monkeypatch) -> List[int]:
    """Every event the native stager sends Python (``GradSync.on_event``), in order."""
    seen: List[int] = []
    on_event = GradSync.on_event

    def counted(self, event: int, arg: int) -> None:
        seen.append(event)
        on_event(self, event, arg)

    monkeypatch.setattr(GradSync, "on_event", counted)
    return seen


def _x(step: int, k: int = 0, device: str = "cpu") -> torch.Tensor:
    return torch.randn(4, 8, generator=torch.Generator().manual_seed(10 * step + k)).to(device)


def _assert_same(model, ref) -> None:
    for a, b in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@native
@devices
def test_a_backward_after_zero_grad_calls_no_python_until_its_end(device, monkeypatch):
    """A backward after ``zero_grad`` sends Python no event (the hook queued the backward's end
    itself, which then runs in Python: the quiet begin); a second backward before the step (no
    zero_grad between) is decided by Python at its first grad (``SLOW``) and arms a plan there.
    Both train as torch's AdamW."""
    model, ref, opt, torch_opt = _pair(device)
    seen = _events(monkeypatch)
    ends: List[int] = []
    quiet_end = GradSync.quiet_end
    monkeypatch.setattr(GradSync, "quiet_end", lambda self: (ends.append(1), quiet_end(self))[1])
    per_backward = []
    for step in range(4):
        opt.zero_grad()
        torch_opt.zero_grad()
        for k in range(2 if step == 2 else 1):  # step 2: two backward passes, the grads added up
            del seen[:]
            model(_x(step, k, device)).square().mean().backward()
            ref(_x(step, k, device)).square().mean().backward()
            per_backward.append(list(seen))
        opt.step()
        torch_opt.step()
    _assert_same(model, ref)
    buckets = len(opt._buckets)
    assert per_backward[0] == per_backward[1] == per_backward[2] == per_backward[4] == []
    assert len(ends) == 4  # each pre-armed backward's end, queued by the hook
    assert per_backward[3][0] == SLOW
    # the second backward before the step adds to the landed shards: from Python, bucket by bucket
    assert per_backward[3].count(COMPLETE) == buckets


@native
@devices
def test_no_sync_after_zero_grad_undoes_the_plan(device, monkeypatch):
    """``no_sync`` entered after ``zero_grad``: its backward must hold the grads back, which the
    plan set at zero_grad would have landed and launched. Python decides that backward's first
    grad; the backward after it reduces everything; training equals torch's over the summed grads."""
    model, ref, opt, torch_opt = _pair(device)
    seen = _events(monkeypatch)
    for step in range(3):
        opt.zero_grad()
        torch_opt.zero_grad()
        del seen[:]
        with opt.no_sync():
            model(_x(step, 0, device)).square().mean().backward()
        assert seen and seen[0] == SLOW, seen
        model(_x(step, 1, device)).square().mean().backward()
        ref(_x(step, 0, device)).square().mean().backward()
        ref(_x(step, 1, device)).square().mean().backward()
        opt.step()
        torch_opt.step()
    _assert_same(model, ref)


@native
@devices
def test_a_shard_read_inside_backward_ends_the_plan_first(device):
    """A hook reads a released shard in the middle of a backward whose plan was set at zero_grad
    (a bucket not landed yet: reading it allocates zeros), through GradSync (``shard``): the plan
    ends first, the bucket lands into the shard that was read (its reader sees the grads), and
    training equals torch's."""
    model, ref, opt, torch_opt = _pair(device)
    last = len(opt._buckets) - 1  # the first layers' bucket: launched last, released until then
    held = []

    def read_shard(grad: torch.Tensor) -> torch.Tensor:
        held.append(opt._grad_sync.shard(last))
        return grad

    for step in range(3):
        opt.zero_grad()
        torch_opt.zero_grad()
        held.clear()
        h = model[1](model[0](_x(step, 0, device)))
        h.register_hook(read_shard)  # runs before the first layer's grads exist
        model[4](model[3](model[2](h))).square().mean().backward()
        ref(_x(step, 0, device)).square().mean().backward()
        assert len(held) == 1 and held[0] is opt._buffers[last].grad_shard
        assert float(held[0].abs().sum()) > 0  # the grads landed into the shard that was read
        opt.step()
        torch_opt.step()
    _assert_same(model, ref)


@native
def test_a_shard_read_around_grad_sync_during_the_plan_raises():
    """A released shard read directly (not through GradSync) after ``zero_grad`` set the plan: the
    hook lands that bucket into a shard of its own, and adopting it raises, naming the fix,
    instead of training on the zeros that were read."""
    model, _, opt, _ = _pair("cpu")
    opt.zero_grad()
    opt._buffers[0].grad_shard  # allocates zeros beside the plan
    with pytest.raises(RuntimeError, match="read it through GradSync.shard"):
        model(_x(0)).square().mean().backward()
