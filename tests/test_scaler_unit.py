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


class _NoScaler:
    """What a loop without any scaler does, behind the scaler's interface."""

    def __init__(self, *args, **kwargs) -> None:
        pass

    def scale(self, loss):
        return loss

    def unscale_(self, opt) -> None:
        pass

    def step(self, opt) -> None:
        opt.step()

    def update(self) -> None:
        pass

    def get_scale(self) -> float:
        return 1.0


def test_disabled_scaler_is_transparent() -> None:
    """enabled=False trains bit for bit as no scaler at all (steps 3, 4 and 7 hold an inf: with
    no scaler those steps are skipped by the optimizer's non-finite rule, not by the scaler)."""
    ours = _train(ShardedGradScaler, DistributedFusedAdam, enabled=False, steps=6)
    plain = _train(_NoScaler, DistributedFusedAdam, steps=6)
    assert ours[1] == [1.0] * 6
    torch.testing.assert_close(torch.tensor(ours[2]), torch.tensor(plain[2]), rtol=0, atol=0, equal_nan=True)
    for a, b in zip(ours[0], plain[0]):
        assert torch.equal(a, b)
    first = _train(_NoScaler, DistributedFusedAdam, steps=1)
    assert any(not torch.equal(a, b) for a, b in zip(ours[0], first[0]))  # it did train


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
    """Infs at steps 3, 4 and 7 (init 256, growth every 2 clean steps): with hysteresis=3 no run
    of 3 overflows happens, so the scale never backs off, while torch's backs off at each; both
    grow alike on clean steps (an overflow restarts the growth count, as in torch)."""
    ours = _train(ShardedGradScaler, torch.optim.SGD, hysteresis=3, steps=10)
    ref = _train(torch.amp.GradScaler, torch.optim.SGD, steps=10)
    assert ours[1][:3] == ref[1][:3] == [256.0, 512.0, 512.0]
    assert ours[1] == [256.0, 512.0, 512.0, 512.0, 512.0, 512.0, 1024.0, 1024.0, 1024.0, 2048.0]
    assert ref[1] == [256.0, 512.0, 512.0, 256.0, 128.0, 128.0, 256.0, 128.0, 128.0, 256.0]


def test_state_dict_round_trip() -> None:
    """A scaler restored mid-run (after back-offs, growth and a partly used hysteresis) goes on
    exactly as the original does."""
    def run(scaler, model, opt, steps):
        scales = []
        for step in steps:
            x, y = _data(step)
            opt.zero_grad()
            scaler.scale(nn.functional.mse_loss(model(x), y)).backward()
            scaler.step(opt)
            scaler.update()
            scales.append(scaler.get_scale())
        return scales

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = ShardedGradScaler("cpu", init_scale=4.0, growth_interval=2, hysteresis=2)
    assert run(scaler, model, opt, range(4)) == [4.0, 8.0, 8.0, 8.0]  # step 3: first overflow kept
    sd = copy.deepcopy(scaler.state_dict())
    assert sd["_hysteresis_tracker"] == 1
    other = ShardedGradScaler("cpu")
    other.load_state_dict(sd)
    assert other.state_dict() == sd
    assert other.get_scale() == 8.0 and other.get_growth_interval() == 2
    model2 = copy.deepcopy(model)
    opt2 = torch.optim.SGD(model2.parameters(), lr=0.01)
    cont = run(scaler, model, opt, range(4, 9))
    resumed = run(other, model2, opt2, range(4, 9))
    assert cont == resumed and cont[0] == 4.0  # step 4 overflows again: second in a row backs off


@pytest.mark.parametrize("scaler_cls", [ShardedGradScaler, torch.amp.GradScaler])
def test_an_inf_only_in_a_backward_after_unscale_skips_and_backs_off(scaler_cls) -> None:
    """unscale_, then another backward (a new round: added to the unscaled grads, not unscaled
    again) that alone overflows, then step: the step skips on that round's found-inf and update()
    backs off on the same one (ShardedGradScaler as torch's GradScaler handing itself over).
    Deliberately unlike torch's GradScaler + AdamW, which acts on the found-inf of unscale_ only:
    it steps into NaN params and grows the scale."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 2))
    ref = copy.deepcopy(model)
    opt = DistributedFusedAdam(model.parameters(), lr=0.05)
    ropt = torch.optim.AdamW(ref.parameters(), lr=0.05, weight_decay=0.0)
    kw = dict(init_scale=2.0**8, growth_interval=1)
    scaler, rscaler = scaler_cls("cpu", **kw), torch.amp.GradScaler("cpu", **kw)
    x, y = _data(0)
    bad = x.clone()
    bad[1, 2] = float("inf")
    for m, o, s in ((model, opt, scaler), (ref, ropt, rscaler)):
        s.scale(nn.functional.mse_loss(m(x), y)).backward()
        s.unscale_(o)
        s.scale(nn.functional.mse_loss(m(bad), y)).backward()  # the inf comes only now
        before = [p.detach().clone() for p in m.parameters()]
        s.step(o)
        s.update()
        after = list(m.parameters())
        if o is opt:
            assert all(torch.equal(a, b) for a, b in zip(after, before)), "the step was not skipped"
            assert s.get_scale() == 2.0**7, "update() did not back off on the found-inf the step skipped on"
        else:  # torch's: found no inf at unscale_, steps into NaN, grows the scale
            assert not all(torch.isfinite(p).all() for p in after)
            assert s.get_scale() == 2.0**9
