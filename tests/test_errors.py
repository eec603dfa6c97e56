"""Bad input raises a clear error naming the argument; broken param views are caught."""
from __future__ import annotations

import copy

import pytest
import torch
from conftest import set_env
import torch.nn as nn

from shardamp.optim import DistributedFusedAdam, clip_grad_norm_
from shardamp.scaler import ShardedGradScaler


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 2))


@pytest.mark.parametrize(
    "kwargs, name",
    [
        (dict(lr=-1.0), "lr"),
        (dict(lr=float("nan")), "lr"),
        (dict(betas=(0.9, 1.0)), "betas"),
        (dict(betas=(0.9,)), "betas"),
        (dict(eps=-1e-8), "eps"),
        (dict(weight_decay=-0.1), "weight_decay"),
        (dict(max_grad_norm=0.0), "max_grad_norm"),
        (dict(max_grad_norm=float("inf")), "max_grad_norm"),
        (dict(dtype=torch.bfloat16), "dtype"),
        (dict(grad_sync_dtype=torch.int32), "grad_sync_dtype"),
        (dict(param_sync_dtype="bf16"), "param_sync_dtype"),
        (dict(bucket_cap_mb=0), "bucket_cap_mb"),
        (dict(adam_w_mode=1), "adam_w_mode"),
        (dict(capturable="yes"), "capturable"),
        (dict(overlap_grad_sync=None), "overlap_grad_sync"),
    ],
)
def test_bad_constructor_arguments_name_the_argument(kwargs, name) -> None:
    with pytest.raises(ValueError, match=name):
        DistributedFusedAdam(_model().parameters(), **kwargs)


def test_bad_params() -> None:
    with pytest.raises(ValueError, match="empty"):
        DistributedFusedAdam([])
    with pytest.raises(ValueError, match="params"):
        DistributedFusedAdam([torch.zeros(3, requires_grad=True)])
    with pytest.raises(ValueError, match="param_groups\\[1\\]: lr"):
        m = _model()
        DistributedFusedAdam([{"params": m[0].parameters()}, {"params": m[2].parameters(), "lr": -1}])
    p = nn.Parameter(torch.zeros(4, 4).t())  # fine: dense, just transposed
    DistributedFusedAdam([p])
    q = nn.Parameter(torch.zeros(4, 8)[:, ::2])  # not dense
    with pytest.raises(ValueError, match="dense"):
        DistributedFusedAdam([q])


def test_process_group_without_init() -> None:
    with pytest.raises(ValueError, match="process_group"):
        DistributedFusedAdam(_model().parameters(), process_group=object())


def test_add_param_group_after_construction() -> None:
    opt = DistributedFusedAdam(_model().parameters())
    with pytest.raises(RuntimeError, match="add_param_group"):
        opt.add_param_group({"params": [nn.Parameter(torch.zeros(2))]})


def test_bad_hyperparameter_edit_is_caught_at_step() -> None:
    m = _model()
    opt = DistributedFusedAdam(m.parameters())
    m(torch.randn(3, 4)).sum().backward()
    opt.param_groups[0]["betas"] = (0.9, 1.5)
    with pytest.raises(ValueError, match="param_groups\\[0\\]: betas"):
        opt.step()


def test_bad_norm_arguments() -> None:
    m = _model()
    opt = DistributedFusedAdam(m.parameters())
    m(torch.randn(3, 4)).sum().backward()
    with pytest.raises(ValueError, match="norm_type"):
        opt.grad_norm(0)
    with pytest.raises(ValueError, match="norm_type"):
        opt.clip_grad_norm(1.0, norm_type="two")
    with pytest.raises(ValueError, match="max_norm"):
        opt.clip_grad_norm(-1.0)
    with pytest.raises(ValueError, match="inv_scale"):
        opt.unscale_grads(2.0)


def test_module_to_dtype_breaks_the_view() -> None:
    m = _model()
    opt = DistributedFusedAdam(m.parameters())
    m.to(torch.float64)
    m(torch.randn(3, 4, dtype=torch.float64)).sum().backward()
    with pytest.raises(RuntimeError, match="no longer lives in the optimizer's flat buffer"):
        opt.step()


def test_native_view_check_agrees_with_a_python_walk() -> None:
    """The per-step check's native form (refs held, params read from the list as they are)
    gives the answer of a walk over the params in Python: True while every param is its view,
    False after a stray ``.grad``, ``.data =`` of another layout, or a list of another length."""
    m = _model()
    opt = DistributedFusedAdam(m.parameters())
    if opt._view_check is None:
        pytest.skip("the CPU kernels did not build")

    def walk(params) -> bool:
        return len(params) == len(opt._view_refs) and all(
            p.data_ptr() == r.data_ptr() and p.dtype == r.dtype and p.shape == r.shape and p.stride() == r.stride()
            and p.grad is None for p, r in zip(params, opt._view_refs))

    w = m[0].weight
    assert opt._view_check.intact(opt._params) and walk(opt._params)
    w.grad = torch.zeros_like(w)
    assert not opt._view_check.intact(opt._params) and not walk(opt._params)
    w.grad = None
    assert opt._view_check.intact(opt._params) and not opt._view_check.intact(opt._params[:-1])
    w.data = w.data.t()  # the same address, other strides
    assert not opt._view_check.intact(opt._params) and not walk(opt._params)


def test_param_data_assignment_of_another_shape_breaks_the_view() -> None:
    m = _model()
    opt = DistributedFusedAdam(m.parameters())
    w = m[0].weight
    w.data = torch.zeros(w.shape[1], w.shape[0]).t()  # same shape, other strides: not its slot
    m(torch.randn(3, 4)).sum().backward()
    with pytest.raises(RuntimeError, match="no longer lives"):
        opt.step()


def test_world_size_env_without_process_group_raises(monkeypatch) -> None:
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(RuntimeError, match="WORLD_SIZE=2 .*init_process_group"):
        DistributedFusedAdam(_model().parameters())
    monkeypatch.setenv("WORLD_SIZE", "1")
    DistributedFusedAdam(_model().parameters())  # a single-process launch is fine


@pytest.mark.parametrize("kernels", ["native", "reference"])
def test_same_address_view_of_another_layout_breaks_the_view(kernels: str, monkeypatch) -> None:
    # the native one-call check (and the Python walk without it) compares strides, not only
    # the data pointer: a transposed view of the same storage is a break too
    set_env(monkeypatch, "SHARDAMP_KERNELS", kernels)
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2))
    opt = DistributedFusedAdam(m.parameters())
    m(torch.randn(3, 4)).sum().backward()
    opt.step()  # intact views pass
    opt.zero_grad()
    w = m[0].weight
    ptr = w.data_ptr()
    w.data = w.data.t()
    assert w.data_ptr() == ptr and w.shape == (4, 4)
    m(torch.randn(3, 4)).sum().backward()
    with pytest.raises(RuntimeError, match="parameter 0 .* no longer lives in the optimizer's flat buffer"):
        opt.step()


def test_load_state_dict_assign_is_caught() -> None:
    m = _model()
    opt = DistributedFusedAdam(m.parameters())
    m.load_state_dict(copy.deepcopy(m.state_dict()), assign=True)
    m(torch.randn(3, 4)).sum().backward()
    with pytest.raises(RuntimeError, match="no parameter of this optimizer received a gradient"):
        opt.step()


def test_load_state_dict_in_place_keeps_training() -> None:
    """load_state_dict(assign=False) copies INTO the views: the optimizer sees the new weights."""
    m = _model()
    opt = DistributedFusedAdam(m.parameters(), lr=0.1)
    other = _model()
    with torch.no_grad():
        for p in other.parameters():
            p.add_(1.0)
    m.load_state_dict(other.state_dict())
    m(torch.randn(3, 4)).sum().backward()
    opt.step()
    for p, q in zip(m.parameters(), other.parameters()):
        assert not torch.equal(p, q)  # updated from the loaded weights...
        torch.testing.assert_close(p, q, atol=0.11, rtol=0)  # ...by about lr


def test_clip_grad_norm_subset_raises() -> None:
    m = _model()
    opt = DistributedFusedAdam(m.parameters())  # noqa: F841  (a live optimizer owns the params)
    m(torch.randn(3, 4)).sum().backward()
    with pytest.raises(ValueError, match="pass them all"):
        clip_grad_norm_(m[0].parameters(), 1.0)
    del opt


def test_scaler_bad_arguments() -> None:
    with pytest.raises(ValueError, match="hysteresis"):
        ShardedGradScaler("cpu", hysteresis=0)
    with pytest.raises(ValueError, match="backoff_factor"):
        ShardedGradScaler("cpu", backoff_factor=1.5)
    with pytest.raises(ValueError, match="growth_factor"):
        ShardedGradScaler("cpu", growth_factor=0.5)
    with pytest.raises(ValueError, match="growth_interval"):
        ShardedGradScaler("cpu", growth_interval=0)


def test_unscale_grads_twice_raises() -> None:
    m = _model()
    opt = DistributedFusedAdam(m.parameters())
    m(torch.randn(3, 4)).sum().backward()
    opt.unscale_grads(torch.tensor(0.5))
    with pytest.raises(RuntimeError, match="already been called"):
        opt.unscale_grads(torch.tensor(0.5))


def test_param_unfrozen_after_construction_is_caught() -> None:
    m = _model()
    m[0].weight.requires_grad_(False)
    opt = DistributedFusedAdam(m.parameters())
    m[0].weight.requires_grad_(True)  # unfrozen later: no grad hook was registered for it
    m(torch.randn(3, 4)).sum().backward()
    with pytest.raises(RuntimeError, match="has a .grad the optimizer never received"):
        opt.step()
