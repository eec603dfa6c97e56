"""Degenerate values in one process (world 1): a bad tensor lr, unsupported group options, a
degenerate loss scale, bad norm types and max norms; the checkpoints that survive a crash are
test_checkpoint_faults.py, the multi-rank half (ranks that disagree) is test_agreement.py."""
from __future__ import annotations

import copy
import inspect
import pickle
import warnings

import pytest
import torch
import torch.nn as nn

from shardamp.optim import DistributedFusedAdam, clip_grad_norm_
from shardamp.scaler import ShardedGradScaler


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 2))


def _backward(model, scale=1.0, seed=0):
    torch.manual_seed(seed)
    (model(torch.randn(3, 4)).sum() * scale).backward()


def _snapshot(model):
    return [p.detach().clone() for p in model.parameters()]


def _same(model, before):
    return all(torch.equal(a, b) for a, b in zip(model.parameters(), before))


# ====================================================================== tensor lr
@pytest.mark.parametrize("lr, match", [
    (torch.tensor(float("nan")), "lr=tensor\\(nan\\)"),
    (torch.tensor(-1.0), "lr=tensor\\(-1.0\\)"),
    (torch.tensor(float("inf")), "lr=tensor\\(inf\\)"),
    (torch.tensor([1e-3, 1e-3]), "one floating-point element"),
    (torch.tensor(1, dtype=torch.int64), "one floating-point element"),
])
def test_tensor_lr_is_validated_at_construction(lr, match):
    with pytest.raises(ValueError, match=match):
        DistributedFusedAdam(_model().parameters(), lr=lr)


@pytest.mark.parametrize("via", ["grad_norm", "step"])
@pytest.mark.parametrize("bad", [float("nan"), -1.0])
def test_tensor_lr_edited_in_place_is_caught_and_nothing_trains(via, bad):
    model = _model()
    opt = DistributedFusedAdam(model.parameters(), lr=torch.tensor(1e-2))
    _backward(model)
    opt.param_groups[0]["lr"].fill_(bad)  # as a scheduler writing a device lr would
    before = _snapshot(model)
    with pytest.raises(ValueError, match="param_groups\\[0\\]: lr"):
        opt.grad_norm() if via == "grad_norm" else opt.step()
    with pytest.raises(ValueError, match="param_groups\\[0\\]: lr"):
        opt.step()
    assert _same(model, before)


def test_tensor_lr_replaced_by_a_bad_one_through_param_groups():
    model = _model()
    opt = DistributedFusedAdam(model.parameters())
    _backward(model)
    opt.param_groups[0]["lr"] = torch.tensor([1e-3, 1e-3])
    before = _snapshot(model)
    with pytest.raises(ValueError, match="one floating-point element"):
        opt.step()
    assert _same(model, before)


def test_tensor_lr_in_a_loaded_state_dict_is_validated():
    model = _model()
    opt = DistributedFusedAdam(model.parameters())
    _backward(model)
    opt.step()
    sd = opt.state_dict()
    sd["param_groups"][0]["lr"] = torch.tensor(float("nan"))
    before = opt.state_dict()
    with pytest.raises(ValueError, match="lr=tensor\\(nan\\)"):
        opt.load_state_dict(sd)
    assert opt.state_dict()["param_groups"][0]["lr"] == before["param_groups"][0]["lr"]


# ====================================================================== group options, params
@pytest.mark.parametrize("key, value", [("maximize", True), ("amsgrad", True), ("foreach", True), ("fused", True),
                                        ("differentiable", True)])
def test_unsupported_group_options_raise(key, value):
    with pytest.raises(ValueError, match=f"param_groups\\[0\\]: {key}=True is not supported"):
        DistributedFusedAdam([{"params": _model().parameters(), key: value}])


def test_unsupported_option_set_later_raises_at_step():
    model = _model()
    opt = DistributedFusedAdam(model.parameters())
    _backward(model)
    opt.param_groups[0]["maximize"] = True
    with pytest.raises(ValueError, match="maximize=True is not supported"):
        opt.step()


def test_torchs_default_group_keys_are_accepted():
    """The keys torch.optim.AdamW writes into every group, at their defaults, are not options."""
    defaults = {k: v for k, v in torch.optim.AdamW([nn.Parameter(torch.zeros(1))]).param_groups[0].items()
                if k in ("amsgrad", "maximize", "foreach", "differentiable", "fused")}
    DistributedFusedAdam([{"params": _model().parameters(), **defaults}])


def test_a_param_given_twice_raises_naming_it():
    model = _model()
    w = model[0].weight
    with pytest.raises(ValueError, match="parameter 2 \\(shape \\(6, 4\\)\\) is parameter 1 given again"):
        DistributedFusedAdam([model[0].bias, w, w])


def test_zero_numel_params_train_as_torch():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 0), nn.Linear(0, 3), nn.Linear(3, 2))
    ref = copy.deepcopy(model)
    opt = DistributedFusedAdam(model.parameters(), lr=0.1, weight_decay=0.01)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=0.1, weight_decay=0.01)
    for step in range(3):
        x = torch.randn(2, 4)
        for m, o in ((model, opt), (ref, ref_opt)):
            m(x).sum().backward()
            o.step()
            o.zero_grad()
    for a, b in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    sd = opt.state_dict()
    torch_sd = ref_opt.state_dict()
    assert sorted(sd["state"]) == sorted(torch_sd["state"])
    assert all(sd["state"][i]["exp_avg"].shape == torch_sd["state"][i]["exp_avg"].shape for i in sd["state"])


def test_deepcopy_and_pickle_raise_naming_state_dict():
    opt = DistributedFusedAdam(_model().parameters())
    with pytest.raises(TypeError, match="state_dict\\(\\)"):
        copy.deepcopy(opt)
    with pytest.raises(TypeError, match="state_dict\\(\\)"):
        pickle.dumps(opt)


# ====================================================================== loss scale
def test_loss_scale_zero_skips_the_step():
    model = _model()
    opt = DistributedFusedAdam(model.parameters(), lr=0.1)
    scaler = ShardedGradScaler("cpu", init_scale=4.0)
    scaler.scale(model(torch.randn(3, 4)).sum()).backward()
    scaler.update(new_scale=torch.tensor(0.0))  # a tensor new_scale is not read on the host
    opt.zero_grad()
    scaler.scale(model(torch.randn(3, 4)).sum()).backward()
    before = _snapshot(model)
    scaler.step(opt)
    scaler.update()
    assert bool(scaler.last_step_skipped) and _same(model, before)


def test_denormal_init_scale_skips_instead_of_nan():
    model = _model()
    opt = DistributedFusedAdam(model.parameters(), lr=0.1)
    scaler = ShardedGradScaler("cpu", init_scale=1e-45)  # 1 / scale overflows float32
    scaler.scale(model(torch.randn(3, 4)).sum()).backward()
    before = _snapshot(model)
    scaler.step(opt)
    scaler.update()
    assert bool(scaler.last_step_skipped) and _same(model, before)
    assert all(torch.isfinite(p).all() for p in model.parameters())


@pytest.mark.parametrize("inv", [float("inf"), float("nan"), 0.0, -1.0])
def test_unscale_grads_with_a_degenerate_inverse_scale_skips(inv):
    model = _model()
    opt = DistributedFusedAdam(model.parameters(), lr=0.1)
    _backward(model)
    before = _snapshot(model)
    found = opt.unscale_grads(torch.tensor(inv))
    opt.step()
    assert float(found) == 1.0 and _same(model, before)


@pytest.mark.parametrize("bad", [0.0, -1.0, float("inf"), float("nan")])
def test_init_scale_and_new_scale_are_validated(bad):
    with pytest.raises(ValueError, match="init_scale"):
        ShardedGradScaler("cpu", init_scale=bad)
    scaler = ShardedGradScaler("cpu")
    with pytest.raises(ValueError, match="new_scale"):
        scaler.update(new_scale=bad)
    with pytest.raises(ValueError, match="new_scale"):
        scaler.update(new_scale=torch.tensor([1.0, 2.0]))


# ====================================================================== norms and clipping
def test_huge_norm_type_is_rejected_naming_inf():
    model = _model()
    opt = DistributedFusedAdam(model.parameters())
    _backward(model)
    with pytest.raises(ValueError, match="norm_type=1000000.0.*float\\('inf'\\)"):
        opt.clip_grad_norm(1.0, norm_type=1e6)
    with pytest.raises(ValueError, match="norm_type"):
        clip_grad_norm_(model.parameters(), 1.0, norm_type=1e6)
    assert torch.isfinite(opt.grad_norm(64.0))


def test_clip_grad_norm_has_torchs_signature():
    ours = inspect.signature(clip_grad_norm_).parameters
    theirs = inspect.signature(torch.nn.utils.clip_grad_norm_).parameters
    assert list(ours) == list(theirs)
    assert [p.default for p in ours.values()] == [p.default for p in theirs.values()]


@pytest.mark.parametrize("bad", [-1.0, float("nan")])
def test_clip_grad_norm_rejects_negative_and_nan_max_norm(bad):
    model = _model()
    DistributedFusedAdam(model.parameters())
    _backward(model)
    with pytest.raises(ValueError, match="max_norm"):
        clip_grad_norm_(model.parameters(), bad)


@pytest.mark.parametrize("bad", [-1.0, float("nan"), torch.tensor(-1.0), torch.tensor(float("nan")),
                                 torch.tensor([1.0, 2.0]), True])
@pytest.mark.parametrize("entry", ["method", "function"])
def test_one_max_norm_check_for_both_clips(bad, entry):
    """opt.clip_grad_norm and clip_grad_norm_ share one check (hparams.check_max_norm)."""
    model = _model()
    opt = DistributedFusedAdam(model.parameters())
    _backward(model)
    with pytest.raises(ValueError, match="max_norm"):
        opt.clip_grad_norm(bad) if entry == "method" else clip_grad_norm_(model.parameters(), bad)


def test_tensor_max_norm_clips_as_the_float():
    results = []
    for max_norm in (0.05, torch.tensor(0.05)):
        model = _model()
        opt = DistributedFusedAdam(model.parameters(), lr=0.1)
        _backward(model)
        opt.clip_grad_norm(max_norm)
        opt.step()
        results.append(_snapshot(model))
    assert all(torch.equal(a, b) for a, b in zip(*results))


def test_invalid_tensor_max_norm_left_to_the_device_skips_the_step_and_raises():
    """On CUDA a tensor max_norm is never read on the host: its check runs on the device at the
    step (hparams.clip_invalid), skips the step and raises through the deferred flags. The same
    path, fed directly on the CPU (where check_max_norm would have read it):"""
    model = _model()
    opt = DistributedFusedAdam(model.parameters(), lr=0.1)
    _backward(model)
    before = _snapshot(model)
    opt._add_clip(torch.tensor(-1.0), opt.grad_norm())
    with pytest.raises(ValueError, match="max_norm is a tensor holding NaN or a negative value"):
        opt.step()
    assert _same(model, before)


@pytest.mark.parametrize("sharded", [True, False])
def test_clip_grad_norm_error_if_nonfinite_as_torch(sharded):
    model = _model()
    if sharded:
        DistributedFusedAdam(model.parameters())
    _backward(model, scale=float("inf"))
    with pytest.raises(RuntimeError, match="non-finite"):
        clip_grad_norm_(model.parameters(), 1.0, error_if_nonfinite=True)
    norm = clip_grad_norm_(model.parameters(), 1.0, error_if_nonfinite=False, foreach=False)
    assert not torch.isfinite(norm)


def test_clip_grad_norm_plain_params_with_foreach_match_torch():
    a, b = _model(), _model()
    _backward(a)
    _backward(b)
    ours = clip_grad_norm_(a.parameters(), 0.1, foreach=True)
    theirs = torch.nn.utils.clip_grad_norm_(b.parameters(), 0.1, foreach=True)
    torch.testing.assert_close(ours, theirs)
    for p, q in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(p.grad, q.grad)


def test_opt_clip_grad_norm_before_unscale_warns_once_torchs_idiom_not_at_all():
    """opt.clip_grad_norm before unscaling compares its max_norm with the true norm (loop G): a
    scaled max_norm there is a mistake, warned once. torch's idiom through clip_grad_norm_ clips
    the scaled grads as torch does: no warning."""
    model = _model()
    opt = DistributedFusedAdam(model.parameters())
    scaler = ShardedGradScaler("cpu", init_scale=1024.0)
    for step in range(3):
        opt.zero_grad()
        scaler.scale(model(torch.randn(3, 4)).sum()).backward()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            if step == 0:
                clip_grad_norm_(model.parameters(), 1.0 * scaler.get_scale())  # torch's documented idiom
            else:
                opt.clip_grad_norm(1.0 * scaler.get_scale())
            scaler.step(opt)
            scaler.update()
        messages = [str(w.message) for w in caught if "before unscaling" in str(w.message)]
        if step == 1:
            assert len(messages) == 1 and "opt.clip_grad_norm" in messages[0] and "unscaled max_norm" in messages[0]
        else:
            assert not messages  # torch's idiom: as torch; then once


def test_fp16_overflow_without_a_scaler_warns_after_a_few_skips():
    model = _model()
    opt = DistributedFusedAdam(model.parameters(), grad_sync_dtype=torch.float16)
    before = _snapshot(model)
    caught_at = None
    for step in range(6):
        opt.zero_grad()
        _backward(model, scale=1e6)  # grads above fp16's 65504: inf in the fp16 reduction
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            opt.step()
        if caught_at is None and any("grad_sync_dtype=torch.float32" in str(w.message) for w in caught):
            caught_at = step
            assert any("ShardedGradScaler" in str(w.message) for w in caught)
    assert caught_at == 2  # after three consecutive skips, once
    assert _same(model, before)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_cuda_tensor_lr_nan_skips_on_the_device_and_raises_at_the_next_step():
    torch.manual_seed(0)
    model = nn.Linear(4, 3).cuda()
    opt = DistributedFusedAdam(model.parameters(), lr=torch.tensor(1e-2, device="cuda"), capturable=True)
    model(torch.randn(2, 4, device="cuda")).sum().backward()
    opt.param_groups[0]["lr"].fill_(float("nan"))
    before = _snapshot(model)
    opt.step()  # no host read here: the device skips
    assert _same(model, before)
    opt.zero_grad()
    model(torch.randn(2, 4, device="cuda")).sum().backward()
    with pytest.raises(ValueError, match="invalid|lr"):
        opt.step()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_cuda_tensor_max_norm_is_never_read_on_the_host():
    """A CUDA tensor max_norm: clip and step run under sync debug "error" (no host read); a NaN
    one skips the step on the device and raises at the next step."""
    torch.manual_seed(0)
    model = nn.Linear(4, 3).cuda()
    opt = DistributedFusedAdam(model.parameters(), lr=0.1)
    max_norm = torch.tensor(0.05, device="cuda")
    for bad in (False, True):
        model(torch.randn(2, 4, device="cuda")).sum().backward()
        if bad:
            max_norm.fill_(float("nan"))
        before = _snapshot(model)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            opt.clip_grad_norm(max_norm)
            opt.step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
        assert _same(model, before) == bad
        opt.zero_grad()
    model(torch.randn(2, 4, device="cuda")).sum().backward()
    with pytest.raises(ValueError, match="max_norm is a tensor holding NaN"):
        opt.step()
