"""ShardedGradScaler on its own (one process): torch.amp.GradScaler's semantics for ordinary
optimizers (the spirit of torch's test_grad_scaling_* tests), hysteresis, state dicts."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

from shardamp.optim import DistributedFusedAdam
from shardamp.scaler import ShardedGradScaler

KW = dict(init_scale=2.0**8, growth_interval=2)


def _data(step: int):
    g = torch.Generator().manual_seed(step)
    x = torch.randn(4, 5, generator=g)
    if step in (3, 4, 7):
        x[1, 2] = float("inf") if step != 4 else float("nan")
    return x, torch.randn(4, 2, generator=g)


def _train(scaler_cls, opt_cls, steps: int = 10, unscale: bool = True, **scaler_kw):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 2))
    opt = opt_cls(model.parameters(), lr=0.05, weight_decay=0.0)  # AdamW defaults to 0.01, we to 0.0
    scaler = scaler_cls("cpu", **{**KW, **scaler_kw})
    scales, norms = [], []
    for step in range(steps):
        x, y = _data(step)
        opt.zero_grad()
        scaler.scale(nn.functional.mse_loss(model(x), y)).backward()
        if unscale:
            scaler.unscale_(opt)
            if isinstance(opt, DistributedFusedAdam):
                norms.append(float(opt.clip_grad_norm(0.5)))
            else:
                norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)))
        scaler.step(opt)
        scaler.update()
        scales.append(scaler.get_scale())
    return [p.detach().clone() for p in model.parameters()], scales, norms


@pytest.mark.parametrize("opt_cls", [torch.optim.SGD, torch.optim.AdamW])
@pytest.mark.parametrize("unscale", [True, False])
def test_foreign_optimizer_behaves_exactly_like_grad_scaler(opt_cls, unscale) -> None:
    ours = _train(ShardedGradScaler, opt_cls, unscale=unscale)
    ref = _train(torch.amp.GradScaler, opt_cls, unscale=unscale)
    assert ours[1] == ref[1]
    for a, b in zip(ours[0], ref[0]):
        assert torch.equal(a, b)
    assert min(ref[1]) < KW["init_scale"] < max(ref[1])  # both backed off and grew


def test_sharded_optimizer_matches_grad_scaler_with_adamw() -> None:
    ours = _train(ShardedGradScaler, DistributedFusedAdam)
    ref = _train(torch.amp.GradScaler, torch.optim.AdamW)
    assert ours[1] == ref[1]
    for a, b in zip(ours[0], ref[0]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    finite = [(a, b) for a, b in zip(ours[2], ref[2]) if b == b and b != float("inf")]
    assert len(finite) >= 5
    for a, b in finite:
        assert a == pytest.approx(b, rel=1e-4)


@pytest.mark.parametrize("opt_cls", [torch.optim.SGD, DistributedFusedAdam])
def test_misuse_errors_like_torch(opt_cls) -> None:
    model = nn.Linear(3, 1)
    opt = opt_cls(model.parameters(), lr=0.1)
    scaler = ShardedGradScaler("cpu")
    scaler.scale(model(torch.randn(2, 3)).sum()).backward()
    scaler.unscale_(opt)
    with pytest.raises(RuntimeError, match="unscale_\\(\\) has already been called"):
        scaler.unscale_(opt)
    scaler.step(opt)
    with pytest.raises(RuntimeError, match="step\\(\\) has already been called"):
        scaler.step(opt)
    with pytest.raises(RuntimeError, match="after step"):
        scaler.unscale_(opt)
    scaler.update()
    with pytest.raises(RuntimeError, match="Closure"):
        scaler.step(opt, closure=lambda: 0.0)


def test_step_before_scale_raises() -> None:
    model = nn.Linear(3, 1)
    opt = DistributedFusedAdam(model.parameters())
    scaler = ShardedGradScaler("cpu")
    model(torch.randn(2, 3)).sum().backward()
    with pytest.raises(AssertionError, match="scaler.scale"):  # torch's own check and message
        scaler.step(opt)


def test_disabled_scaler_is_transparent() -> None:
    a = _train(ShardedGradScaler, DistributedFusedAdam, enabled=False, steps=3)
    torch.manual_seed(0)
    assert a[1] == [1.0, 1.0, 1.0]


def test_no_future_warning_with_sharded_optimizer() -> None:
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        _train(ShardedGradScaler, DistributedFusedAdam, steps=3)


def test_hysteresis_backs_off_after_consecutive_overflows() -> None:
    scaler = ShardedGradScaler("cpu", init_scale=64.0, growth_interval=100, hysteresis=2)
    model = nn.Linear(3, 1)
    opt = DistributedFusedAdam(model.parameters(), lr=0.1)

    def one_step(bad: bool):
        x = torch.randn(2, 3)
        if bad:
            x[0, 0] = float("inf")
        scaler.scale(model(x).sum()).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        return scaler.get_scale(), bool(scaler.last_step_skipped)

    assert one_step(True) == (64.0, True)  # first overflow: skipped, scale kept
    assert one_step(False) == (64.0, False)  # a clean step restores the hysteresis
    assert one_step(True) == (64.0, True)
    assert one_step(True) == (32.0, True)  # second consecutive overflow: back off
    assert one_step(True) == (16.0, True)  # still overflowing: keep backing off
    sd = scaler.state_dict()
    assert sd["hysteresis"] == 2 and sd["_hysteresis_tracker"] == 0
    fresh = ShardedGradScaler("cpu")
    fresh.load_state_dict(copy.deepcopy(sd))
    assert fresh.hysteresis == 2
    assert fresh.state_dict() == sd


def test_hysteresis_one_is_torch() -> None:
    ours = _train(ShardedGradScaler, torch.optim.SGD, hysteresis=1)
    ref = _train(torch.amp.GradScaler, torch.optim.SGD)
    assert ours[1] == ref[1]


def test_growth_with_hysteresis_matches_torch_between_overflows() -> None:
    ours = _train(ShardedGradScaler, torch.optim.SGD, hysteresis=3, steps=3)  # no inf before step 3
    ref = _train(torch.amp.GradScaler, torch.optim.SGD, steps=3)
    assert ours[1] == ref[1]


def test_state_dict_round_trip() -> None:
    _, _, _ = _train(ShardedGradScaler, DistributedFusedAdam, steps=5)
    scaler = ShardedGradScaler("cpu", init_scale=4.0, growth_interval=7, hysteresis=3)
    scaler.scale(torch.ones(()))  # materialise the scale
    sd = scaler.state_dict()
    other = ShardedGradScaler("cpu")
    other.load_state_dict(sd)
    assert other.state_dict() == sd
    assert other.get_scale() == 4.0 and other.get_growth_interval() == 7
