"""A managed param's class (optim/torch_tools.py ``GradClasses``): the class whose ``.grad`` shows
the optimizer's grads while it holds them, the param's own class otherwise; two optimizers over
one model, a model's own Parameter subclass, torch.save and copies in either state, and
torch.compile over a gradient-accumulation loop (``SHARDAMP_SWITCH_PARAM_CLASS``); every loop
against torch's AdamW."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

from parity import ATOL, RTOL, two_groups
from shardamp.optim import DistributedFusedAdam, torch_tools
from shardamp.optim.torch_tools import ShardedGrad
from test_grad_views import _backward, _setup, _step_both_and_compare


def _classes(model) -> set:
    return {type(p) for p in model.parameters()}


def _grads_match(model, ref) -> None:
    """``p.grad`` reads as torch's (its norm: the one op a shown grad computes locally)."""
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad.norm(), q.grad.norm(), rtol=1e-5, atol=0)


def _classes_inside_backward(model) -> list:
    """Records the params' classes from a hook on conv1's output grad, which runs once the later
    layers' grads reached the optimizer, before the backward ends."""
    seen: list = []

    def on_forward(module, inputs, out) -> None:
        out.register_hook(lambda g: seen.append(_classes(model)))

    model.conv1.register_forward_hook(on_forward)
    return seen


@pytest.mark.parametrize("kw", [{}, {"capturable": True}], ids=["native hooks", "python hooks"])
def test_params_have_torchs_class_unless_grads_are_held(kw) -> None:
    """The class whose .grad shows the optimizer's grads is the params' from the end of the
    backward that delivered them to the zero_grad that drops them; torch's own class the rest of
    the time (the forward after zero_grad pays no __torch_function__ lookup), inside backward
    too, also across accumulation and zero_grad(set_to_none=False); p.grad reads as torch's in
    every state."""
    model, ref, opt = _setup(**kw)
    ropt = torch.optim.AdamW(two_groups(ref))
    inside = _classes_inside_backward(model)
    assert _classes(model) == {nn.Parameter}  # built: no grads held
    for step in range(3):
        _backward(model, step)
        _backward(ref, step)
        assert inside[-1] == {nn.Parameter}  # switched once the backward ended, not at its first grad
        (shown,) = _classes(model)
        assert shown is not nn.Parameter and shown._shardamp_grad_base is nn.Parameter
        _backward(model, 10 + step)  # accumulation: still held, still shown
        _backward(ref, 10 + step)
        assert _classes(model) == {shown}
        _grads_match(model, ref)
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
    """Two optimizers over one model, the older holding grads when the newer is built: the newer
    owns the params; the older's zero_grad neither hides the newer's grads nor shows its own."""
    model, ref, old = _setup()
    _backward(model)  # the older holds grads (its params show them) ...
    assert _classes(model) != {nn.Parameter}
    new = DistributedFusedAdam(two_groups(model), bucket_cap_mb=0.0004)
    assert _classes(model) == {nn.Parameter}  # ... until the newer takes the params over
    ropt = torch.optim.AdamW(two_groups(ref))
    for step in range(2):
        _backward(model, step)
        _backward(ref, step)
        shown = _classes(model)
        assert shown != {nn.Parameter}
        old.zero_grad()  # the older's grads dropped: the newer's stay shown
        assert _classes(model) == shown
        _grads_match(model, ref)
        _step_both_and_compare(new, ropt, model, ref)
        assert _classes(model) == {nn.Parameter}


def test_a_failed_construction_leaves_the_params_with_their_optimizer(monkeypatch) -> None:
    """A newer optimizer whose construction raises after its grad hooks exist: the older keeps
    the params' grads (no collection in between) and trains as torch's AdamW."""
    import shardamp.optim.distributed_fused_adam as dfa

    model, ref, old = _setup()
    ropt = torch.optim.AdamW(two_groups(ref))

    def fail(*args, **kwargs):
        raise MemoryError("no memory for the grads' view")

    monkeypatch.setattr(dfa, "GradSource", fail)
    with pytest.raises(MemoryError, match="grads' view"):
        DistributedFusedAdam(two_groups(model), bucket_cap_mb=0.0004)
    monkeypatch.undo()
    for step in range(3):
        _backward(model, step)
        _backward(ref, step)
        _grads_match(model, ref)
        _step_both_and_compare(old, ropt, model, ref)


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
    """torch.compile over a gradient-accumulation loop trains as torch. The forwards after a
    backward see the showing class: where dynamo guards on the params' classes (torch 2.13) it
    compiles a second graph, once, never one a step (torch 2.11 compiles one);
    SHARDAMP_SWITCH_PARAM_CLASS=0 keeps one class: one graph."""
    assert 1 <= _accumulating_compiled(pinned=False) <= 2
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
    (the showing class): it pickles as a model nothing manages (its params torch's own class,
    no grads, no optimizer reachable); a deep copy of a param is a Parameter nothing manages."""
    import io

    model, ref, opt = _setup()
    for held in (False, True):
        if held:
            _backward(model)
            assert _classes(model) != {nn.Parameter}
        buf = io.BytesIO()
        torch.save(model, buf)
        buf.seek(0)
        loaded = torch.load(buf, weights_only=False)
        assert _classes(loaded) == {nn.Parameter}
        assert all(q.grad is None and torch_tools.owner(q) is None for q in loaded.parameters())
        for p, q in zip(model.parameters(), loaded.parameters()):
            assert torch.equal(p, q)
        twin = copy.deepcopy(model.conv1.weight)
        assert type(twin) is nn.Parameter and torch_tools.owner(twin) is None
    # the loaded model trains under an optimizer of its own, as torch's does
    _backward(ref)
    ropt = torch.optim.AdamW(two_groups(ref))
    lopt = DistributedFusedAdam(two_groups(loaded), bucket_cap_mb=0.0004)
    _backward(loaded)
    _step_both_and_compare(lopt, ropt, loaded, ref)


def _shardamp_frames(fn) -> int:
    """Python functions of the shardamp package that a second ``fn()`` enters."""
    import sys
    from pathlib import Path

    import shardamp

    root = str(Path(shardamp.optim.__file__).resolve().parent)
    count = [0]

    def profile(frame, event, arg) -> None:
        if event == "call" and str(Path(frame.f_code.co_filename).resolve()).startswith(root):
            count[0] += 1

    fn()  # the first read makes each param's view (once)
    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return count[0]


@pytest.mark.parametrize("reader", ["p.grad", "clip_grad_norm_"])
def test_reading_a_models_grads_costs_few_python_frames_per_param(reader: str) -> None:
    """torch's clip and GradScaler read ``p.grad`` per param each step (clip_grad_norm_ twice),
    and on a host-bound GPU loop every Python frame there is a microsecond or more: a read enters
    two of shardamp's functions (the property's getter, the view's flag), a whole
    ``torch.nn.utils.clip_grad_norm_`` at most six per param, counted as the growth between a
    4- and a 12-layer MLP (the per-call rest is constant). The grads read are still the true ones."""
    def build(layers: int):
        torch.manual_seed(0)
        model = nn.Sequential(*[nn.Linear(8, 8) for _ in range(layers)])
        opt = DistributedFusedAdam(model.parameters(), lr=1e-3)
        ref = copy.deepcopy(model)
        x = torch.randn(4, 8)
        for m in (model, ref):
            m(x).square().sum().backward()
        return model, ref, opt

    frames = []
    for layers in (4, 12):
        model, ref, opt = build(layers)
        params = list(model.parameters())
        if reader == "p.grad":
            frames.append(_shardamp_frames(lambda: [p.grad for p in params]))
            _grads_match(model, ref)
        else:
            norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 1e9)
            frames.append(_shardamp_frames(lambda: torch.nn.utils.clip_grad_norm_(params, 1e9)))
            torch.testing.assert_close(opt.grad_norm(), norm, rtol=1e-5, atol=0)
    per_param = (frames[1] - frames[0]) / 16
    assert per_param <= (2 if reader == "p.grad" else 6), (frames, per_param)
