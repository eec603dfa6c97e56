"""A managed param's class (optim/torch_tools.py ``GradClasses``): the class whose ``.grad`` shows
the optimizer's grads while it holds them, the param's own class otherwise; two optimizers over
one model, a model's own Parameter subclass, torch.save and copies in either state, and
torch.compile over a gradient-accumulation loop (``SHARDAMP_SWITCH_PARAM_CLASS``); every loop
against torch's AdamW."""
from __future__ import annotations

import copy

import torch
import torch.nn as nn

from parity import ATOL, RTOL, two_groups
from shardamp.optim import DistributedFusedAdam, torch_tools
from shardamp.optim.torch_tools import ShardedGrad
from test_grad_views import _backward, _setup, _step_both_and_compare


def _classes(model) -> set:
    return {type(p) for p in model.parameters()}


def test_params_have_torchs_class_unless_grads_are_held() -> None:
    """The class whose .grad shows the optimizer's grads is the params' from a backward's first
    grad to the zero_grad that drops them; torch's own class the rest of the time (the forward
    after zero_grad pays no __torch_function__ lookup), also across accumulation and
    zero_grad(set_to_none=False); p.grad reads as torch's in every state."""
    model, ref, opt = _setup()
    ropt = torch.optim.AdamW(two_groups(ref))
    assert _classes(model) == {nn.Parameter}  # built: no grads held
    for step in range(3):
        _backward(model, step)
        _backward(ref, step)
        (shown,) = _classes(model)
        assert shown is not nn.Parameter and shown._shardamp_grad_base is nn.Parameter
        _backward(model, 10 + step)  # accumulation: still held, still shown
        _backward(ref, 10 + step)
        assert _classes(model) == {shown}
        for p, q in zip(model.parameters(), ref.parameters()):
            torch.testing.assert_close(p.grad.norm(), q.grad.norm(), rtol=1e-5, atol=0)
        opt.step()
        ropt.step()
        if step == 1:  # zeros kept, as torch keeps them: still shown
            opt.zero_grad(set_to_none=False)
            ropt.zero_grad(set_to_none=False)
            assert _classes(model) == {shown}
            assert all(float(p.grad.norm()) == 0.0 for p in model.parameters())
        opt.zero_grad()
        ropt.zero_grad()
        assert _classes(model) == {nn.Parameter}
        assert all(p.grad is None for p in model.parameters())
        for p, q in zip(model.parameters(), ref.parameters()):
            torch.testing.assert_close(p, q, rtol=RTOL, atol=ATOL)


def test_an_older_optimizer_leaves_the_params_a_newer_one_owns() -> None:
    """Two optimizers over one model: the newer owns the params; the older's zero_grad neither
    hides the newer's grads nor shows its own."""
    model, ref, old = _setup()
    new = DistributedFusedAdam(two_groups(model), bucket_cap_mb=0.0004)
    _backward(model)
    _backward(ref)
    shown = _classes(model)
    assert shown != {nn.Parameter}
    old.zero_grad()
    assert _classes(model) == shown
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad.norm(), q.grad.norm(), rtol=1e-5, atol=0)
    new.zero_grad()
    assert _classes(model) == {nn.Parameter}


def _accumulating_compiled(pinned: bool) -> int:
    """Two micro-batches a step under torch.compile (a counting backend, no codegen), against
    torch's AdamW in eager mode; returns the graphs compiled."""
    from shardamp.optim import config

    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    before = config.explicit().get("switch_param_class")
    config.configure(switch_param_class=not pinned)
    try:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
        ref = copy.deepcopy(model)
        opt = DistributedFusedAdam(model.parameters(), lr=1e-2, weight_decay=0.01)
    finally:
        config.configure(switch_param_class=before)
    ropt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.01)
    compiled = torch.compile(model, backend=backend)
    for step in range(3):
        for micro in range(2):
            g = torch.Generator().manual_seed(10 * step + micro)
            x, y = torch.randn(5, 8, generator=g), torch.randn(5, 4, generator=g)
            nn.functional.mse_loss(compiled(x), y).backward()
            nn.functional.mse_loss(ref(x), y).backward()
            if pinned:
                assert _classes(model) != {nn.Parameter}
        _step_both_and_compare(opt, ropt, model, ref)
    torch._dynamo.reset()
    return len(graphs)


def test_a_compiled_accumulation_loop_trains_as_torch_and_the_pinned_class_compiles_once() -> None:
    """torch.compile over a gradient-accumulation loop: the forwards after a backward see the
    showing class, so dynamo compiles a second graph (once), and training matches torch;
    SHARDAMP_SWITCH_PARAM_CLASS=0 keeps one class: one graph."""
    assert _accumulating_compiled(pinned=False) == 2
    assert _accumulating_compiled(pinned=True) == 1


def test_a_parameter_subclass_gets_its_own_class_back() -> None:
    """A model's own Parameter subclass: shown as a subclass of it, and given back to it."""
    class Tagged(nn.Parameter):
        pass

    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    model.weight = Tagged(model.weight.detach().clone())
    opt = DistributedFusedAdam(model.parameters())
    assert type(model.weight) is Tagged
    model(torch.randn(2, 4)).sum().backward()
    assert issubclass(type(model.weight), Tagged) and type(model.weight) is not Tagged
    assert type(model.weight.grad) is ShardedGrad
    opt.step()
    opt.zero_grad()
    assert type(model.weight) is Tagged and type(model.bias) is nn.Parameter


def test_torch_save_of_the_model_in_either_state_holds_no_shardamp_state() -> None:
    """torch.save(model) between zero_grad and backward (torch's own class) and after backward
    (the showing class): nothing of shardamp in the params' __dict__, weights_only loading works,
    a copy of a param is not managed."""
    import io

    model, _, opt = _setup()
    for held in (False, True):
        if held:
            _backward(model)
        buf = io.BytesIO()
        torch.save(model.state_dict(keep_vars=True), buf)
        buf.seek(0)
        loaded = torch.load(buf, weights_only=True)
        for name, p in model.named_parameters():
            assert not [k for k in vars(p) if k.startswith("_shardamp")]
            assert torch.equal(loaded[name], p) and loaded[name].grad is None
        twin = copy.deepcopy(model.conv1.weight)
        assert type(twin) is nn.Parameter and twin.grad is None and torch_tools.owner(twin) is None
        assert torch.equal(twin, model.conv1.weight) and twin.requires_grad
