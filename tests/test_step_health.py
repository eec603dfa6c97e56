"""The step's health in one process (world 1): named params, last_nonfinite, grad_norms_by_group,
step_stats, skip_grad_norm_above, and the ``shardamp`` logger's rate limiting. The multi-rank
cases (an inf on one rank only, spikes in every AMP loop, per-group norms over uneven shards) are
in cases_scaler.py / amp_loops.py, run by test_scaler_loops.py."""
from __future__ import annotations

import copy
import logging
import math

import pytest
import torch
import torch.nn as nn

from conftest import set_env
from parity import MLP, named_two_groups, two_groups
from shardamp.optim import DistributedFusedAdam
from shardamp.scaler import ShardedGradScaler

KEYS = {"steps", "skipped_steps", "skipped_spike", "skipped_nonfinite", "consecutive_skips", "last_grad_norm",
        "loss_scale"}


def _batch(step: int, scale: float = 1.0):
    g = torch.Generator().manual_seed(step)
    return torch.randn(4, 12, generator=g), torch.randn(4, 5, generator=g) * scale


def _torch_norm(model, step: int, scale: float = 1.0) -> float:
    """torch's global grad norm of ``model``'s params as they are now, on ``_step``'s batch."""
    ref = copy.deepcopy(model)
    for p in ref.parameters():
        p.grad = None
    x, y = _batch(step, scale)
    nn.functional.mse_loss(ref(x), y).backward()
    return float(torch.nn.utils.clip_grad_norm_(ref.parameters(), math.inf))


def _step(model, opt, step: int, poison: float = 0.0, scale: float = 1.0, scaler=None, zero: bool = True):
    if zero:
        opt.zero_grad()
    device = next(model.parameters()).device
    x, y = (t.to(device) for t in _batch(step, scale))
    if poison:
        x = x.clone()
        x[0, 0] = poison
    loss = nn.functional.mse_loss(model(x), y)
    if scaler is None:
        loss.backward()
        opt.step()
    else:
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()


@pytest.mark.parametrize("value", [0.0, -1.0, math.inf, math.nan, True, "1", torch.tensor(1.0)])
def test_skip_grad_norm_above_is_validated(value) -> None:
    with pytest.raises(ValueError, match="skip_grad_norm_above=.*expected None or a finite float > 0"):
        DistributedFusedAdam(MLP().parameters(), skip_grad_norm_above=value)


def test_named_parameters_as_torch_accepts_them() -> None:
    """model.named_parameters() and groups of (name, param) pairs are accepted as torch's
    optimizers accept them: param_names per group, the same state dict as torch.optim.AdamW's
    (names included), a dict without names keeps the optimizer's, a mix of named and unnamed
    groups is refused as torch refuses it."""
    torch.manual_seed(0)
    model = MLP()
    ref = copy.deepcopy(model)
    opt = DistributedFusedAdam(model.named_parameters(), lr=1e-2)
    ropt = torch.optim.AdamW(ref.named_parameters(), lr=1e-2, weight_decay=0.0)
    assert opt.param_groups[0]["param_names"] == [n for n, _ in model.named_parameters()]
    for step in range(3):
        _step(model, opt, step)
        _step(ref, ropt, step)
    for a, b in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    sd, rsd = opt.state_dict(), ropt.state_dict()
    assert sd["param_groups"] == rsd["param_groups"]
    unnamed = copy.deepcopy(rsd)
    for g in unnamed["param_groups"]:
        del g["param_names"]
    opt.load_state_dict(unnamed)
    assert opt.param_groups[0]["param_names"] == [n for n, _ in model.named_parameters()]
    groups = named_two_groups(MLP())
    assert [g["param_names"] for g in DistributedFusedAdam(groups).param_groups] == [
        ["a.weight", "a.bias"], ["b.weight", "b.bias", "c.weight", "head.weight", "head.bias"]]
    mixed = named_two_groups(MLP())
    mixed[1]["params"] = [p for _, p in mixed[1]["params"]]
    with pytest.raises(ValueError, match="with/without names"):
        DistributedFusedAdam(mixed)
    bad = dict(rsd, param_groups=[dict(rsd["param_groups"][0], param_names=["x"])])
    with pytest.raises(ValueError, match="param_names"):
        opt.load_state_dict(bad)


def test_last_nonfinite_names_and_default_names() -> None:
    """The param whose grad held the inf, by its name or, unnamed, "group g, param i, shape
    (...)"; empty for finite steps; kept while the grads are (no zero_grad between two steps),
    dropped with them (zero_grad(set_to_none=False) too)."""
    torch.manual_seed(0)
    model = MLP()
    opt = DistributedFusedAdam(two_groups(model))
    assert opt.last_nonfinite() == []
    _step(model, opt, 0)
    assert opt.last_nonfinite() == []
    _step(model, opt, 1, poison=math.inf)
    assert opt.last_nonfinite() == [(0, "group 0, param 0, shape (20, 12)")]
    with pytest.warns(UserWarning, match="without opt.zero_grad"):
        _step(model, opt, 2, zero=False)  # the inf is still in the grads: skipped again
    assert opt.last_nonfinite() == [(0, "group 0, param 0, shape (20, 12)")]
    opt.zero_grad(set_to_none=False)
    _step(model, opt, 3, zero=False)
    assert opt.last_nonfinite() == []
    named = DistributedFusedAdam(named_two_groups(model))
    _step(model, named, 4, poison=-math.inf)
    assert named.last_nonfinite() == [(0, "a.weight")]
    assert named.step_stats()["skipped_nonfinite"] == 1


@pytest.mark.parametrize("device, backend", [("cpu", "native"), ("cpu", "reference"), pytest.param(
    "cuda", "native", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"))])
@pytest.mark.parametrize("scaled", [False, True])
def test_flags_of_an_earlier_round_do_not_come_back(device: str, backend: str, scaled: bool, monkeypatch) -> None:
    """The round's non-finite flags live in two buffers taking turns (the last step's are kept
    beside the current ones); the one a round swaps in was zeroed by the last step's scalar
    launch, not at ``zero_grad``. An inf in the buffer that comes round again every second round
    neither skips a later finite step nor shows in its report: the params match torch's AdamW
    over the steps applied, and a NaN in another param four steps later is reported alone. On
    CUDA the plain step's launch is the one-block head of the step's one call, the scaled step's
    the scalar launch."""
    if backend == "reference":
        set_env(monkeypatch, "SHARDAMP_KERNELS", "reference")
    torch.manual_seed(0)
    model = MLP().to(device)
    ref = copy.deepcopy(model)
    opt = DistributedFusedAdam(two_groups(model), lr=1e-2)
    ropt = torch.optim.AdamW(two_groups(ref), lr=1e-2, weight_decay=0.0)
    scaler = ShardedGradScaler(device, init_scale=2.0**10, growth_interval=1000) if scaled else None
    _step(model, opt, 0, poison=math.inf, scaler=scaler)
    assert opt.last_nonfinite() == [(0, "group 0, param 0, shape (20, 12)")]
    for step in (1, 2, 3):  # step 2's round starts from the buffer step 0 flagged the inf in
        _step(model, opt, step, scaler=scaler)
        _step(ref, ropt, step)
        assert opt.last_nonfinite() == []
    stats = opt.step_stats()
    assert stats["steps"] == 3 and stats["skipped_nonfinite"] == 1 and stats["consecutive_skips"] == 0
    for a, b in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    model.head.weight.register_hook(lambda g: g.clone().fill_(math.nan))  # another param's grad, this time
    _step(model, opt, 4, scaler=scaler)  # that buffer again
    assert opt.last_nonfinite() == [(0, "group 1, param 3, shape (5, 20)")]


def test_scaled_world1_reads_the_device_when_asked() -> None:
    """A scaler at world 1 reads nothing back per step: the report is read from the device
    when asked, and step_stats() reports the scale and the skip (one host read)."""
    torch.manual_seed(0)
    model = MLP()
    opt = DistributedFusedAdam(model.named_parameters())
    scaler = ShardedGradScaler("cpu", init_scale=2.0**10)
    _step(model, opt, 0, scaler=scaler)
    _step(model, opt, 1, poison=math.inf, scaler=scaler)
    assert opt.last_nonfinite() == [(0, "a.weight")]
    stats = opt.step_stats()
    assert stats["loss_scale"] == scaler.get_scale() == 2.0**9
    assert stats["skipped_nonfinite"] == 1 and stats["consecutive_skips"] == 1 and stats["steps"] == 1
    assert math.isinf(stats["last_grad_norm"]) or math.isnan(stats["last_grad_norm"])


def test_step_stats_counts_and_spikes() -> None:
    """step_stats(): every key always present, None before the first step; spikes (norm above
    skip_grad_norm_above) counted apart from non-finite steps, consecutive skips across both,
    the last norm the unscaled one grad_norm() hands out; the params do not move on a skip."""
    torch.manual_seed(0)
    model = MLP()
    opt = DistributedFusedAdam(model.parameters(), skip_grad_norm_above=50.0)
    first = opt.step_stats()
    assert set(first) == KEYS and first["last_grad_norm"] is None and first["loss_scale"] is None
    assert first["steps"] == first["skipped_steps"] == first["consecutive_skips"] == 0
    assert opt.skip_grad_norm_above == 50.0 and "skip_grad_norm_above=50.0" in repr(opt)
    want = _torch_norm(model, 0)  # unsharded torch, before the step moves the params
    _step(model, opt, 0)
    assert opt.step_stats()["last_grad_norm"] == pytest.approx(want, rel=1e-5)
    assert opt.step_stats()["last_grad_norm"] == float(opt.grad_norm())  # the one grad_norm() hands out
    before = [p.detach().clone() for p in model.parameters()]
    _step(model, opt, 1, scale=1000.0)  # a spike
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    spike_norm = float(opt.grad_norm())
    assert spike_norm > 50.0 and spike_norm == pytest.approx(_torch_norm(model, 1, scale=1000.0), rel=1e-5)
    _step(model, opt, 2, poison=math.inf)
    stats = opt.step_stats()
    assert not math.isfinite(stats.pop("last_grad_norm"))  # the overflowing step's norm
    assert stats == dict(steps=1, skipped_steps=2, skipped_spike=1, skipped_nonfinite=1, consecutive_skips=2,
                         loss_scale=None)
    assert opt.last_nonfinite() == [(0, "group 0, param 0, shape (20, 12)")]
    _step(model, opt, 3)
    assert opt.step_stats()["consecutive_skips"] == 0 and opt.step_stats()["steps"] == 2


def test_spike_is_not_an_overflow_for_the_scaler() -> None:
    """With a scaler, a spike skips the step but the scale neither backs off nor stops
    counting toward growth (torch counts every step without an overflow)."""
    torch.manual_seed(0)
    model = MLP()
    opt = DistributedFusedAdam(model.parameters(), skip_grad_norm_above=50.0)
    scaler = ShardedGradScaler("cpu", init_scale=2.0**10, growth_interval=2)
    _step(model, opt, 0, scaler=scaler)
    _step(model, opt, 1, scale=1000.0, scaler=scaler)  # the second step without overflow: grows
    assert scaler.get_scale() == 2.0**11 and not bool(scaler.last_step_skipped)
    stats = opt.step_stats()
    assert stats["skipped_spike"] == 1 and stats["skipped_nonfinite"] == 0 and stats["loss_scale"] == 2.0**11


def _decay_groups(model: nn.Module):
    """The frameworks' two groups: decay on the matrices, none on the vectors (so every bucket
    holds segments of both)."""
    return [{"params": [p for p in model.parameters() if p.dim() >= 2], "weight_decay": 0.1},
            {"params": [p for p in model.parameters() if p.dim() < 2], "weight_decay": 0.0}]


@pytest.mark.parametrize("copy_grads", [False, True])
def test_grad_norms_by_group_of_a_plain_step_world1(copy_grads: bool, monkeypatch) -> None:
    """No clip and no scaler: the step's stats are finished in its own call, which forms each
    group's norm too (over the grads held where autograd left them, or over the landed shards
    with ``SHARDAMP_COPY_GRADS``). Against torch's norm of each group's grads, read after the
    step: two groups interleaved in every bucket, several buckets, a layer left out of one
    backward (its grads None)."""
    set_env(monkeypatch, "SHARDAMP_COPY_GRADS", "1" if copy_grads else "0")
    torch.manual_seed(0)
    model = MLP()
    ref = copy.deepcopy(model)
    opt = DistributedFusedAdam(_decay_groups(model), lr=1e-2, bucket_cap_mb=0.001)
    assert len(opt._buckets) >= 3
    for step in range(3):
        skip = ("b",) if step == 1 else ()
        opt.zero_grad()
        ref.zero_grad()
        x, y = _batch(step)
        nn.functional.mse_loss(ref(x, skip), y).backward()
        nn.functional.mse_loss(model(x, skip), y).backward()
        want = [float(torch.nn.utils.get_total_norm([p.grad for p in g["params"] if p.grad is not None]))
                for g in _decay_groups(ref)]
        opt.step()
        assert opt.grad_norms_by_group().tolist() == pytest.approx(want, rel=1e-5)
        with torch.no_grad():
            for p, q in zip(ref.parameters(), model.parameters()):
                p.copy_(q)


def test_grad_norms_by_group_world1() -> None:
    """Each group's norm against torch.nn.utils.get_total_norm of its grads, 2 and inf, before
    and after the step (unscaled); a new tensor each call, on the params' device."""
    torch.manual_seed(0)
    model = MLP()
    ref = copy.deepcopy(model)
    opt = DistributedFusedAdam(two_groups(model))
    scaler = ShardedGradScaler("cpu", init_scale=2.0**8)
    for norm_type in (2.0, math.inf):
        opt.zero_grad()
        ref.zero_grad()
        x, y = _batch(7)
        nn.functional.mse_loss(ref(x), y).backward()
        want = [float(torch.nn.utils.get_total_norm([p.grad for p in g["params"]], norm_type))
                for g in two_groups(ref)]
        scaler.scale(nn.functional.mse_loss(model(x), y)).backward()
        if math.isinf(norm_type):
            opt.grad_norm(norm_type)  # the first norm asked: the step's stats in that norm type
        scaler.unscale_(opt)
        got = opt.grad_norms_by_group()
        assert got.dtype == torch.float32 and got.shape == (2,)
        assert got.tolist() == pytest.approx(want, rel=1e-5)
        scaler.step(opt)
        scaler.update()
        assert opt.grad_norms_by_group().tolist() == got.tolist()
        with torch.no_grad():
            for p, q in zip(ref.parameters(), model.parameters()):
                p.copy_(q)


def test_logger_once_per_burst(caplog) -> None:
    """The shardamp logger: one warning when a burst of skipped steps starts (naming the
    param, or the norm of a spike), nothing for the rest of the burst, one info line when a step
    is applied after several skips; loss-scale back-offs once per burst of back-offs."""
    torch.manual_seed(0)
    model = MLP()
    opt = DistributedFusedAdam(model.named_parameters(), skip_grad_norm_above=50.0)
    with caplog.at_level(logging.INFO, logger="shardamp"):
        _step(model, opt, 0)
        _step(model, opt, 1, poison=math.inf)
        _step(model, opt, 2, poison=math.nan)
        _step(model, opt, 3, scale=1000.0)
        _step(model, opt, 4)
        _step(model, opt, 5)
        _step(model, opt, 6, scale=1000.0)
    records = [(r.levelname, r.getMessage()) for r in caplog.records if r.name == "shardamp"]
    assert [level for level, _ in records] == ["WARNING", "INFO", "WARNING"], records
    assert records[0][1].startswith("step 2 skipped: non-finite gradients (rank 0: a.weight)")
    assert records[1][1] == "step 5 applied after 3 skipped steps in a row"
    assert records[2][1].startswith("step 7 skipped: gradient norm") and "skip_grad_norm_above=50" in records[2][1]
    caplog.clear()
    health = opt._health  # the scales a scaled step pushes, as deferred.py hands them over
    with caplog.at_level(logging.INFO, logger="shardamp"):
        for step, scale in enumerate([1024.0, 512.0, 256.0, 256.0, 256.0, 128.0, 256.0], start=100):
            health.observe(step, [0.0, 1.0, 0.0, 1.0 / scale], scaled=True)
    backoffs = [r.getMessage() for r in caplog.records if "backed off" in r.getMessage()]
    assert backoffs == ["loss scale backed off from 1024 to 512 before step 101; further back-offs in a row are "
                        "not logged",
                        "loss scale backed off from 256 to 128 before step 105; further back-offs in a row are "
                        "not logged"], backoffs


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_no_scaler_skips_reach_the_host_on_cuda(caplog) -> None:
    """CUDA without a scaler: each step's health record reaches the host at the next step
    (the step's scalar launch writes it into pinned memory itself; the two slots take turns),
    so every burst of skipped steps is logged once, naming the param that held the inf, a
    skipped step leaves the params as they were and step_stats() counts the skips."""
    torch.manual_seed(0)
    model = MLP().cuda()
    opt = DistributedFusedAdam(model.named_parameters(), lr=1e-2)
    poisoned = {1, 4, 5, 8}  # bursts at steps 2, 5-6 and 9 (counted from 1), in both slots
    with caplog.at_level(logging.INFO, logger="shardamp"):
        for step in range(11):
            before = [p.detach().clone() for p in model.parameters()]
            _step(model, opt, step, poison=math.inf if step in poisoned else 0.0)
            changed = [not torch.equal(a, p) for a, p in zip(before, model.parameters())]
            assert (not any(changed)) if step in poisoned else all(changed), (step, changed)
    warned = [r.getMessage() for r in caplog.records if r.name == "shardamp" and r.levelname == "WARNING"]
    assert [m.split(":")[0] for m in warned] == ["step 2 skipped", "step 5 skipped", "step 9 skipped"], warned
    assert all("non-finite gradients (rank 0: a.weight)" in m for m in warned), warned
    stats = opt.step_stats()
    assert stats["steps"] == 7 and stats["skipped_steps"] == 4 and stats["consecutive_skips"] == 0, stats


def test_capturable_keeps_flag_addresses() -> None:
    """capturable=True: the flags are copied, never swapped (a captured graph reads fixed
    addresses), and the report still names the last step's overflow."""
    torch.manual_seed(0)
    model = MLP()
    opt = DistributedFusedAdam(model.named_parameters(), capturable=True)
    health = opt._health
    ptrs = (health.flags.data_ptr(), health.last_flags.data_ptr())
    for step in range(4):
        _step(model, opt, step, poison=math.inf if step == 2 else 0.0)
        assert opt.last_nonfinite() == ([(0, "a.weight")] if step == 2 else []), step
    assert (health.flags.data_ptr(), health.last_flags.data_ptr()) == ptrs


def test_group_norms_after_a_step_a_scaler_skipped_on_the_host() -> None:
    """A subclass without in-kernel skipping (``_step_supports_amp_scaling = False``): the scaler
    skips an overflowing step on the host; grad_norms_by_group() then reports that step's norms
    (non-finite where the inf was) instead of raising, and a finite step's equal torch's per group."""

    class HostSkipped(DistributedFusedAdam):
        _step_supports_amp_scaling = False

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
    ref = copy.deepcopy(model)
    opt = HostSkipped([{"params": model[0].parameters()}, {"params": model[2].parameters()}], lr=1e-3)
    scaler = ShardedGradScaler("cpu", init_scale=2.0**10)
    x = torch.randn(5, 3)
    scaler.scale(model(x).square().sum()).backward()
    ref(x).square().sum().backward()
    scaler.step(opt)
    scaler.update()
    want = [float(torch.nn.utils.get_total_norm([p.grad for p in ref[i].parameters()])) for i in (0, 2)]
    assert opt.grad_norms_by_group().tolist() == pytest.approx(want, rel=1e-5)
    opt.zero_grad()
    x[0, 0] = math.inf  # group 0's weight grad only: the tanh keeps group 1's finite
    scaler.scale(model(x).square().sum()).backward()
    scaler.step(opt)
    scaler.update()
    assert opt.step_stats()["skipped_nonfinite"] == 1
    norms = opt.grad_norms_by_group()
    assert not torch.isfinite(norms[0]) and torch.isfinite(norms[1])
