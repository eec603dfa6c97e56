"""The landing plan set at ``zero_grad`` (one process, native stager): the next backward's first
grad is staged in the grad hook, which calls no Python but queues the backward's end; its
complete buckets land in the hook. Whatever calls Python before that backward, or changes what it
must do, undoes the plan; training equals torch's AdamW in every case."""
from __future__ import annotations

import copy
from collections import Counter
from typing import List

import pytest
import torch
import torch.nn as nn

from kernel_shards import DEVICES
from landings import count_landings
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


class _Branchy(nn.Module):
    """A three-layer MLP and a side branch ``extra`` (used only where ``forward`` is told to)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 2))
        self.extra = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor, extra: bool = True) -> torch.Tensor:
        out = self.net(x)
        return out + self.extra(x) if extra else out


def _decay_groups(model: nn.Module, wd: float = 0.1) -> List[dict]:
    """The transformers Trainer's groups: decay on matrices, none on biases. The layout's buckets
    follow the reverse of this order, so the first layer's weight completes its bucket before
    the biases' bucket ahead of it in launch order completes."""
    params = list(model.parameters())
    return [{"params": [p for p in params if p.dim() >= 2], "weight_decay": wd},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]


def _completion_order(model: nn.Module, opt: DistributedFusedAdam) -> List[int]:
    """Records, for each backward, the buckets in the order their last grad arrives (a list the
    caller reads); from the optimizer's layout and the params' post-accumulate hooks."""
    params = [p for g in opt.param_groups for p in g["params"]]
    bucket_of = {id(params[slot.index]): b.index for b in opt._buckets for slot in b.slots}
    sizes = {b.index: len(b.slots) for b in opt._buckets}
    left = dict(sizes)
    order: List[int] = []

    # holds no optimizer: a param's hook that did would keep it alive past the test (autograd holds
    # the hook, where Python's collector does not look), and with it torch's wrapped functions
    def arrived(p: torch.Tensor) -> None:
        b = bucket_of[id(p)]
        left[b] -= 1
        if left[b] == 0:
            order.append(b)
            left[b] = sizes[b]

    for p in model.parameters():
        p.register_post_accumulate_grad_hook(arrived)
    return order


def _branchy_pair(device: str):
    torch.manual_seed(0)
    model, ref = _Branchy().to(device), _Branchy().to(device)
    ref.load_state_dict(model.state_dict())
    opt = DistributedFusedAdam(_decay_groups(model), lr=1e-2, bucket_cap_mb=0.0005)
    torch_opt = torch.optim.AdamW(_decay_groups(ref), lr=1e-2)
    return model, ref, opt, torch_opt


@native
@devices
def test_buckets_completing_ahead_of_their_turn_land_in_the_hook_in_launch_order(device, monkeypatch):
    """The Trainer's decay groups: a bucket completes before the one launched ahead of it. It
    waits, staged, and the hook lands it right after that one, calling no Python in the whole
    backward; the buckets land in launch order (the round's first assigns the shared norm
    partial), and training and the grad norm equal torch's AdamW and ``clip_grad_norm_``."""
    model, ref, opt, torch_opt = _branchy_pair(device)
    order = _completion_order(model, opt)
    seen = _events(monkeypatch)
    calls: Counter = Counter()
    assigned: List[bool] = []
    count_landings(opt._grad_sync, calls, assigned)
    landings = opt._grad_sync.landings
    landed: List[int] = []
    end_quiet = landings.end_quiet

    def recorded_end_quiet():
        out = end_quiet()
        landed.extend(i for i, _ in out[1])  # the buckets the hook landed, in its order
        return out

    landings.end_quiet = recorded_end_quiet
    buckets = len(opt._buckets)
    assert buckets >= 3
    for step in range(4):
        opt.zero_grad()
        torch_opt.zero_grad()
        del seen[:], order[:], assigned[:], landed[:]
        model(_x(step, 0, device)).square().mean().backward()
        ref(_x(step, 0, device)).square().mean().backward()
        assert sorted(order) == list(range(buckets)) and order != sorted(order), order  # some bucket ran ahead
        assert seen == [], seen
        assert landed == list(range(buckets)), landed  # the hook's landings, in launch order
        assert assigned == [True] + [False] * (buckets - 1)
        norm = opt.clip_grad_norm(1.0)
        torch.testing.assert_close(norm, torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0).to(norm.device),
                                   rtol=1e-5, atol=0)
        opt.step()
        torch_opt.step()
    assert calls["planned"] == 4 * buckets
    _assert_same(model, ref)


@native
@devices
def test_a_bucket_ahead_of_one_that_never_completes_lands_at_the_backward_end(device, monkeypatch):
    """A side branch left out of some steps' forward: the biases' bucket (launched first) never
    completes in those backward passes, so the buckets completing after it wait, staged, through
    the whole backward; its end lands them all in launch order, the unused params without a grad
    as torch's. Every step trains as torch's AdamW (which skips params without a grad)."""
    model, ref, opt, torch_opt = _branchy_pair(device)
    seen = _events(monkeypatch)
    for step in range(5):
        extra = step % 2 == 0
        opt.zero_grad()
        torch_opt.zero_grad()
        del seen[:]
        model(_x(step, 0, device), extra).square().mean().backward()
        ref(_x(step, 0, device), extra).square().mean().backward()
        assert seen == [], seen  # nothing completed in turn: no event either
        before = model.extra.weight.detach().clone()
        opt.step()
        torch_opt.step()
        _assert_same(model, ref)
        assert torch.equal(before, model.extra.weight) == (not extra)  # no grad: not stepped


@native
@devices
def test_a_frozen_bucket_goes_to_python_and_the_plan_lands_the_rest(device, monkeypatch):
    """A frozen layer's bucket (no param of it takes a grad) is complete by its counts from the
    start, with nothing for the hook to land: once the bucket ahead of it has landed, the hook
    hands it to Python (one event), which launches it and arms the plan again, so every other
    bucket still lands in the hook, none waiting behind it for the backward's end. Training equals
    torch's AdamW (which skips the frozen params)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(),
                          nn.Linear(16, 2)).to(device)
    ref = copy.deepcopy(model)
    for net in (model, ref):
        net[4].requires_grad_(False)
    opt = DistributedFusedAdam(model.parameters(), lr=1e-2, weight_decay=0.02, bucket_cap_mb=0.0005)
    torch_opt = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.02)
    states = opt._grad_sync.states
    frozen = [s.index for s in states if s.expected == 0]
    assert len(frozen) == 1 and 0 < frozen[0] < len(states) - 1, [s.expected for s in states]
    seen = _events(monkeypatch)
    calls: Counter = Counter()
    count_landings(opt._grad_sync, calls)
    for step in range(3):
        opt.zero_grad()
        torch_opt.zero_grad()
        del seen[:]
        calls.clear()
        model(_x(step, 0, device)).square().mean().backward()
        ref(_x(step, 0, device)).square().mean().backward()
        assert seen == [COMPLETE], seen
        assert calls["planned"] == len(states) - 1
        opt.step()
        torch_opt.step()
    _assert_same(model, ref)
