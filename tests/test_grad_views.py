"""Grads visible to torch's tools (optim/torch_tools.py, optim/grads_view.py) at world 1, in
process: what p.grad shows and when, the errors that name the fix, full_grad / local_grad, torch's
functions wrapped only for managed params (installed at construction, idempotent, reversible).
The multi-rank parity against torch is in test_scaler_loops.py (grad_reads.py, loops F, H, H0, I)."""
from __future__ import annotations

import copy
import gc

import pytest
import torch
import torch.nn as nn

from parity import ATOL, RTOL, ConvNet, _to_format, two_groups
from shardamp.optim import DistributedFusedAdam, _compat, torch_tools
from shardamp.optim.torch_tools import ShardedGrad


def _setup(**kw):
    torch.manual_seed(0)
    model = _to_format(ConvNet(), torch.channels_last)
    ref = copy.deepcopy(model)
    opt = DistributedFusedAdam(two_groups(model), bucket_cap_mb=0.0004, **kw)
    return model, ref, opt


def _backward(model, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randn(3, 3, 6, 6, generator=g), torch.randn(3, 3, generator=g)
    nn.functional.mse_loss(model(x), y).backward()


def _step_both_and_compare(opt, ropt, model, ref) -> None:
    """Step and zero both optimizers; the params must match torch's."""
    opt.step()
    ropt.step()
    opt.zero_grad()
    ropt.zero_grad()
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=RTOL, atol=ATOL)


def test_p_grad_is_a_view_from_backward_to_zero_grad() -> None:
    model, ref, opt = _setup()
    assert all(p.grad is None for p in model.parameters())  # no backward yet: None, as torch
    _backward(model)
    _backward(ref)
    for p, q in zip(model.parameters(), ref.parameters()):
        assert type(p.grad) is ShardedGrad and _compat.raw_grad(p) is None  # autograd's field stays empty
        assert (p.grad.shape, p.grad.stride(), p.grad.dtype, p.grad.device) == (q.shape, q.grad.stride(), q.dtype,
                                                                               q.device)
        assert isinstance(p, nn.Parameter) and type(p).__name__ == "Parameter"
        torch.testing.assert_close(p.grad.norm(), q.grad.norm(), rtol=1e-5, atol=0)
        torch.testing.assert_close(p.grad.data.norm(3.0), q.grad.norm(3.0), rtol=1e-5, atol=0)
        torch.testing.assert_close(torch.linalg.vector_norm(p.grad, float("inf")), q.grad.abs().max())
    assert "ShardedGrad" in repr(next(model.parameters()).grad)
    opt.zero_grad()
    assert all(p.grad is None for p in model.parameters())
    _backward(model)
    opt.zero_grad(set_to_none=False)  # torch keeps zero grads: so does p.grad
    assert all(float(p.grad.norm()) == 0.0 for p in model.parameters())


def test_a_post_accumulate_hook_still_sees_autograds_grad() -> None:
    model, _, opt = _setup()
    seen = []
    for p in model.parameters():
        p.register_post_accumulate_grad_hook(lambda p: seen.append(type(p.grad)))
    _backward(model)
    assert len(seen) == 6 and ShardedGrad not in seen


@pytest.mark.parametrize("op", [
    lambda g: g + 1, lambda g: g.clone(), lambda g: g.mul_(0.5), lambda g: g.zero_(), lambda g: g.sum(),
    lambda g: torch.isfinite(g).all(), lambda g: g.norm(dim=0), lambda g: copy.deepcopy(g),
])
def test_other_ops_on_the_view_raise_naming_the_fix(op) -> None:
    model, _, opt = _setup()
    _backward(model)
    g = model.conv1.weight.grad
    with pytest.raises(RuntimeError, match=r"opt\.full_grad\(p\).*opt\.local_grad\(p\)"):
        op(g)


def test_model_zero_grad_keeps_the_optimizers_grads() -> None:
    """``p.grad = None`` writes autograd's field; the grads live in the optimizer until opt.zero_grad()."""
    model, _, opt = _setup()
    _backward(model)
    model.zero_grad()
    assert type(model.conv1.weight.grad) is ShardedGrad
    with pytest.raises(RuntimeError, match="opt.zero_grad"):
        model.zero_grad(set_to_none=False)  # zero_() on the view


def test_full_and_local_grad_against_torch_with_a_scaler() -> None:
    from shardamp.scaler import ShardedGradScaler

    model, ref, opt = _setup()
    scaler = ShardedGradScaler("cpu", init_scale=256.0)
    loss_fn = nn.MSELoss()
    x, y = torch.randn(3, 3, 6, 6), torch.randn(3, 3)
    scaler.scale(loss_fn(model(x), y)).backward()
    (loss_fn(ref(x), y) * 256.0).backward()
    for p, q in zip(model.parameters(), ref.parameters()):
        full = opt.full_grad(p)
        assert full.stride() == q.grad.stride()
        torch.testing.assert_close(full, q.grad, rtol=RTOL, atol=ATOL * 256)  # still scaled
        local = opt.local_grad(p)
        assert (local.start, local.end) == (0, p.numel())  # one rank holds all of it
        torch.testing.assert_close(local.tensor, full.as_strided((p.numel(),), (1,)), rtol=0, atol=0)
    scaler.unscale_(opt)
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(opt.full_grad(p), q.grad / 256.0, rtol=RTOL, atol=ATOL)  # unscaled
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.01)
    for q in ref.parameters():
        q.grad /= 256.0
    rnorm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.01)
    torch.testing.assert_close(norm, rnorm, rtol=1e-5, atol=0)
    assert float(rnorm) > 0.01  # the clip engaged
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(opt.full_grad(p), q.grad, rtol=RTOL, atol=ATOL)  # clipped


def test_unmanaged_param_raises() -> None:
    model, _, opt = _setup()
    other = nn.Parameter(torch.zeros(3))
    for call in (opt.full_grad, opt.local_grad):
        with pytest.raises(ValueError, match="not a parameter of this DistributedFusedAdam"):
            call(other)


def test_reads_inside_no_sync_raise() -> None:
    model, _, opt = _setup()
    with opt.no_sync():
        _backward(model)
        p = model.conv1.weight
        for read in (lambda: opt.full_grad(p), lambda: opt.local_grad(p), lambda: p.grad.norm(),
                     lambda: torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0),
                     lambda: torch.nn.utils.get_total_norm([q.grad for q in model.parameters()])):
            with pytest.raises(RuntimeError, match="inside opt.no_sync"):
                read()
    _backward(model)  # the reducing backward: readable now
    assert opt.full_grad(p) is not None and opt.local_grad(p) is not None


def test_local_grad_before_the_reduction_names_grad_sync() -> None:
    model, ref, opt = _setup(overlap_grad_sync=False)
    _backward(model)
    p = model.conv1.weight
    with pytest.raises(RuntimeError, match=r"opt\.grad_sync\(\)"):
        opt.local_grad(p)
    opt.grad_sync()
    _backward(ref)
    torch.testing.assert_close(opt.local_grad(p).tensor, ref.conv1.weight.grad.permute(0, 2, 3, 1).reshape(-1))


def test_full_grad_is_none_without_grads() -> None:
    model, _, opt = _setup()
    assert opt.full_grad(model.conv1.weight) is None and opt.local_grad(model.conv1.weight) is None


def test_clip_of_a_subset_and_clip_by_value_raise() -> None:
    model, ref, opt = _setup()
    _backward(model)
    _backward(ref)
    with pytest.raises(ValueError, match="2 of the 6 params"):
        torch.nn.utils.clip_grad_norm_(list(model.parameters())[:2], 1.0)
    with pytest.raises(ValueError, match="clip_grad_value_"):
        torch.nn.utils.clip_grad_value_(model.parameters(), 0.1)
    # a norm over a subset is fine (no clip): the true norm of those grads
    sub = [p.grad for p in list(model.parameters())[:2]]
    expected = torch.nn.utils.get_total_norm([q.grad for q in list(ref.parameters())[:2]])  # unsharded torch
    torch.testing.assert_close(torch.nn.utils.get_total_norm(sub), expected, rtol=1e-5, atol=0)


def test_mixed_managed_and_plain_params_clip_like_torch() -> None:
    """One call over a DistributedFusedAdam's params and plain ones: the total norm covers both,
    the plain grads are clipped in place as torch does, the managed ones in the step."""
    model, ref, opt = _setup()
    plain, plain_ref = nn.Linear(4, 2), None
    plain_ref = copy.deepcopy(plain)
    ropt = torch.optim.AdamW(two_groups(ref))
    x = torch.randn(2, 4)
    for m in (plain, plain_ref):
        m(x).pow(2).sum().backward()
    _backward(model)
    _backward(ref)
    norm = torch.nn.utils.clip_grad_norm_(list(model.parameters()) + list(plain.parameters()), 0.05)
    rnorm = torch.nn.utils.clip_grad_norm_(list(ref.parameters()) + list(plain_ref.parameters()), 0.05)
    torch.testing.assert_close(norm, rnorm, rtol=1e-5, atol=0)
    for p, q in zip(plain.parameters(), plain_ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad)
    opt.step()
    ropt.step()
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=RTOL, atol=ATOL)


def test_plain_models_get_torchs_functions_unchanged() -> None:
    alive = _setup()  # a live optimizer: the wrappers are installed
    assert torch_tools.installed() and alive
    torch.manual_seed(1)
    a = nn.Linear(5, 3)
    b = copy.deepcopy(a)
    x = torch.randn(4, 5)
    for m in (a, b):
        m(x).pow(2).sum().backward()
    originals = torch_tools._originals
    ours = torch.nn.utils.clip_grad_norm_(a.parameters(), 0.1)
    grads = [p.grad for p in b.parameters()]
    theirs = originals["get_total_norm"](grads)
    originals["clip_grads_with_norm_"](b.parameters(), 0.1, theirs)
    assert torch.equal(ours, theirs)
    for p, q in zip(a.parameters(), b.parameters()):
        assert torch.equal(p.grad, q.grad)
    torch.nn.utils.clip_grad_value_(a.parameters(), 1e-3)
    originals["clip_grad_value_"](b.parameters(), 1e-3)
    for p, q in zip(a.parameters(), b.parameters()):
        assert torch.equal(p.grad, q.grad)


def test_installed_at_construction_idempotent_and_reversible() -> None:
    gc.collect()
    if torch_tools._live:
        torch_tools.uninstall()  # an optimizer of another test still alive: start from torch's own
    from torch.nn.utils import clip_grad

    assert not torch_tools.installed() and clip_grad._get_total_norm is torch.nn.utils.get_total_norm
    model, _, opt = _setup()
    opt2 = DistributedFusedAdam(model.parameters())  # a second optimizer over the same params
    wrapped = torch.nn.utils.get_total_norm
    assert wrapped is torch_tools.get_total_norm and clip_grad._get_total_norm is wrapped
    assert torch.nn.utils.clip_grads_with_norm_ is torch_tools.clip_grads_with_norm_
    assert clip_grad._clip_grads_with_norm_ is torch_tools.clip_grads_with_norm_
    assert wrapped.__wrapped__ is torch_tools._originals["get_total_norm"]  # wrapped once, not twice
    assert type(model.conv1.weight) is nn.Parameter  # no grads held: torch's own class
    _backward(model)
    cls = type(model.conv1.weight)  # grads held: the class whose .grad shows them
    assert cls._shardamp_grad_base is nn.Parameter and cls.__base__ is nn.Parameter
    assert type(model.conv1.weight.grad) is ShardedGrad  # the last optimizer built owns the params
    held = model.conv1.weight.grad
    del opt, opt2
    gc.collect()
    # the last DistributedFusedAdam is gone: torch's functions and the params' classes are back
    assert torch.nn.utils.get_total_norm is torch_tools._originals["get_total_norm"]
    assert clip_grad._clip_grads_with_norm_ is torch_tools._originals["clip_grads_with_norm_"]
    assert torch.nn.utils.clip_grad_value_ is torch_tools._originals["clip_grad_value_"]
    assert all(type(p) is nn.Parameter and p.grad is None for p in model.parameters())
    assert not torch_tools.installed()
    with pytest.raises(RuntimeError, match="garbage-collected|is gone"):
        held.norm()  # a view kept past its optimizer
    _, _, opt3 = _setup()  # builds install again
    assert torch.nn.utils.get_total_norm is torch_tools.get_total_norm
    torch_tools.uninstall()  # and it can be undone by hand
    assert torch.nn.utils.get_total_norm is torch_tools._originals["get_total_norm"]
    assert all(type(p) is nn.Parameter for p in opt3._params)


def test_world1_loop_with_torchs_clip_matches_torch() -> None:
    """fp32, no scaler: torch.nn.utils.clip_grad_norm_ over a DistributedFusedAdam's params
    returns torch's norm and the step applies torch's clip."""
    model, ref, opt = _setup()
    ropt = torch.optim.AdamW(two_groups(ref))
    engaged = False
    for step in range(4):
        for m in (model, ref):
            _backward(m, seed=step)
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
        rnorm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05)
        engaged |= float(rnorm) > 0.05
        torch.testing.assert_close(norm, rnorm, rtol=1e-5, atol=0)
        _step_both_and_compare(opt, ropt, model, ref)
    assert engaged


@pytest.mark.parametrize("bucket_cap_mb", [25.0, 0.0004])
def test_a_clip_before_any_backward_clips_nothing_and_the_next_backward_lands(bucket_cap_mb: float) -> None:
    """zero_grad (which sets the next backward's landing plan at one process), opt.clip_grad_norm
    before any backward, then backward and step: the clip had no grads to act on (torch's clips
    nothing), so the backward lands as usual and the step applies its unclipped grads, as torch's.
    The clip's round used to be folded at the backward, reading the released shards beside the
    plan's landing ("adopt_grad_shard: the shard is held already"). Contiguous grads (Linear
    layers): the hook lands them under the plan."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 6), nn.ReLU(), nn.Linear(6, 3))
    ref = copy.deepcopy(model)
    opt = DistributedFusedAdam(two_groups(model), bucket_cap_mb=bucket_cap_mb)
    ropt = torch.optim.AdamW(two_groups(ref))
    for step in range(4):
        if step >= 2:  # zero_grad came before: the plan is set, no grads exist
            assert opt._grad_sync.landings.planned
            opt.clip_grad_norm(1e-3)
            torch.nn.utils.clip_grad_norm_(ref.parameters(), 1e-3)  # no grads: nothing
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(5, 8, generator=g), torch.randn(5, 3, generator=g)
        for m in (model, ref):
            nn.functional.mse_loss(m(x), y).backward()
        for p, q in zip(model.parameters(), ref.parameters()):
            torch.testing.assert_close(opt.full_grad(p), q.grad, rtol=RTOL, atol=ATOL)
        _step_both_and_compare(opt, ropt, model, ref)


def test_model_to_the_same_device_between_backward_and_step_keeps_the_grads() -> None:
    """``model.to(device)`` (a Trainer moves the model at each call) applies ``.to`` to every
    ``p.grad`` and assigns the result back: to where it is, the view is kept (autograd's field stays
    empty) and the step trains like torch; a cast of a grad alone gives its values cast, as torch's."""
    model, ref, opt = _setup()
    ropt = torch.optim.AdamW(two_groups(ref))
    _backward(model)
    _backward(ref)
    model.to("cpu:0")
    model.to(torch.device("cpu"))
    assert all(type(p.grad) is ShardedGrad and _compat.raw_grad(p) is None for p in model.parameters())
    cast = model.conv1.weight.grad.to(torch.float64)
    assert type(cast) is torch.Tensor and cast.dtype == torch.float64
    torch.testing.assert_close(cast, ref.conv1.weight.grad.double(), rtol=RTOL, atol=ATOL)
    assert _compat.raw_grad(model.conv1.weight) is None  # the param did not move: nothing left in it
    opt.step()
    ropt.step()
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=RTOL, atol=ATOL)


def test_model_moved_once_training_is_over_takes_its_grads_along() -> None:
    """A model moved or cast while the optimizer holds grads (Lightning's teardown under
    ``strategy="auto"`` calls ``module.cpu()`` after the last step): as torch's, its params and
    their grads move, the grads plain tensors with torch's values; the params have left the
    optimizer's buffers, so its next step raises naming that, and the model still moves after
    ``zero_grad`` (then without grads)."""
    model, ref, opt = _setup()
    ropt = torch.optim.AdamW(two_groups(ref))
    for m, o in ((model, opt), (ref, ropt)):
        _backward(m)
        torch.nn.utils.clip_grad_norm_(m.parameters(), 1e-3)
        o.step()
    model.double()
    ref.double()
    for p, q in zip(model.parameters(), ref.parameters()):
        assert type(p.grad) is torch.Tensor and p.grad.dtype == torch.float64 and p.dtype == torch.float64
        assert p.grad.stride() == q.grad.stride()
        torch.testing.assert_close(p.grad, q.grad, rtol=RTOL, atol=ATOL)
        torch.testing.assert_close(p, q, rtol=RTOL, atol=ATOL)
    with pytest.raises(RuntimeError, match="no longer lives in the optimizer's flat buffer"):
        opt.step()
    opt.zero_grad()  # drops the grads the params took along, as torch's
    assert all(p.grad is None for p in model.parameters())
    model2, _, opt2 = _setup()
    _backward(model2)
    opt2.zero_grad()
    model2.double()  # the grads dropped, the params' values move
    assert all(p.dtype == torch.float64 and p.grad is None for p in model2.parameters())


def test_torchs_own_functions_bound_before_the_wrapping_are_true_or_raise() -> None:
    """A caller that bound torch's functions before any optimizer existed (``from torch.nn.utils
    import get_total_norm`` at import) runs torch's own: over the views get_total_norm is still
    the true norm (the per-param norms), clip_grads_with_norm_ raises naming the fix."""
    model, ref, opt = _setup()
    _backward(model)
    _backward(ref)
    own_norm, own_clip = torch_tools._originals["get_total_norm"], torch_tools._originals["clip_grads_with_norm_"]
    expected = own_norm([p.grad for p in ref.parameters()])
    torch.testing.assert_close(own_norm([p.grad for p in model.parameters()]), expected, rtol=1e-5, atol=0)
    with pytest.raises(RuntimeError, match=r"opt\.full_grad\(p\)"):
        own_clip(model.parameters(), 0.01, expected)


def test_torch_save_of_the_whole_model_works_and_loads_plain() -> None:
    """torch.save(model) after the optimizer is built and has stepped (a pattern torch trains
    with): the saved model is torch's plain one (Parameter class, no shardamp tags), its weights
    the trained ones; the live model keeps training as the unsharded reference does."""
    import io

    model, ref, opt = _setup()
    torch_opt = torch.optim.AdamW(two_groups(ref), lr=1e-3, weight_decay=0.0)
    for seed in range(2):
        for m, o in ((model, opt), (ref, torch_opt)):
            o.zero_grad()
            _backward(m, seed)
            o.step()
        if seed == 0:
            buf = io.BytesIO()
            torch.save(model, buf)
            buf.seek(0)
            saved = torch.load(buf, weights_only=False)
            for p, q in zip(saved.parameters(), model.parameters()):
                assert type(p) is nn.Parameter and not [k for k in vars(p) if k.startswith("_shardamp")]
                assert torch.equal(p, q) and p.stride() == q.stride()
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


def test_a_norm_handed_out_before_unscale_clips_as_given() -> None:
    """clip_grads_with_norm_ given opt.grad_norm() (the tensor unscale_ divides in place) before
    unscale_: torch compares max_norm with the value given then, the scaled norm; so does the step."""
    from shardamp.scaler import ShardedGradScaler

    model, ref, opt = _setup()
    ropt = torch.optim.AdamW(two_groups(ref))
    scaler = ShardedGradScaler("cpu", init_scale=256.0)
    rscaler = torch.amp.GradScaler("cpu", init_scale=256.0)
    loss_fn = nn.MSELoss()
    x, y = torch.randn(3, 3, 6, 6), torch.randn(3, 3)
    scaler.scale(loss_fn(model(x), y)).backward()
    rscaler.scale(loss_fn(ref(x), y)).backward()
    norm = opt.grad_norm()
    rnorm = torch.nn.utils.get_total_norm([q.grad for q in ref.parameters()])
    torch.testing.assert_close(norm, rnorm, rtol=1e-5, atol=0)
    torch.nn.utils.clip_grads_with_norm_(model.parameters(), 0.05 * 256.0, norm.detach())
    torch.nn.utils.clip_grads_with_norm_(ref.parameters(), 0.05 * 256.0, rnorm)
    assert float(rnorm) > 0.05 * 256.0  # the clip engaged
    scaler.step(opt)
    rscaler.step(ropt)
    torch.testing.assert_close(norm * 256.0, rnorm, rtol=1e-5, atol=0)  # opt.grad_norm(): unscaled in place
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=RTOL, atol=ATOL)
