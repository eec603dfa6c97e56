"""The ``offload`` options (optim/offload.py): every value the constructor refuses, with the error
naming it and the fix, and ``offload="cpu"`` itself refused as not available yet before any state
is allocated (the multi-rank agreement on the options: test_agreement.py)."""
from __future__ import annotations

import math

import pytest
import torch

from shardamp.optim import DistributedFusedAdam
from shardamp.optim.offload import OffloadOptions, resolve_offload


def _model(dtype=torch.float32):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(7, 5), torch.nn.Linear(5, 3)).to(dtype)


def test_default_keeps_the_state_on_the_params_device():
    options = resolve_offload(None, None, False, False)
    assert options == OffloadOptions() and not options.enabled
    assert options.agreed() == {"offload": None, "offload_fraction": None}
    options.refuse_unavailable()  # nothing to refuse
    opt = DistributedFusedAdam(_model().parameters(), offload=None)
    assert opt.memory_stats()["master"] == 0  # fp32 params: the state as before, nothing moved


@pytest.mark.parametrize("fraction,expected", [(None, 1.0), (1, 1.0), (0.5, 0.5), (0.0, 0.0), (1.0, 1.0)])
def test_fraction_defaults_to_one_and_takes_zero_to_one(fraction, expected):
    options = resolve_offload("cpu", fraction, False, False)
    assert options.enabled and options.offload == "cpu"
    assert options.fraction == expected and isinstance(options.fraction, float)
    assert options.agreed() == {"offload": "cpu", "offload_fraction": expected}


@pytest.mark.parametrize("value", ["gpu", "CPU", "nvme", "cuda", True, 1, torch.device("cpu")])
def test_unknown_offload_values_raise_naming_the_accepted_ones(value):
    with pytest.raises(ValueError) as info:
        DistributedFusedAdam(_model().parameters(), offload=value)
    assert str(info.value) == (
        f"offload={value!r}: expected None (the state on the params' device) or 'cpu' (each rank's owned fp32 "
        "master and moments in host memory); offloading to NVMe is not planned (docs/offload.md)")


@pytest.mark.parametrize("fraction", [0.5, 1.0, 0.0])
def test_fraction_without_offload_raises(fraction):
    with pytest.raises(ValueError, match=rf"offload_fraction={fraction} without offload: it is the share of the "
                                         r"owned state kept in host memory; pass offload='cpu' with it"):
        DistributedFusedAdam(_model().parameters(), offload_fraction=fraction)


@pytest.mark.parametrize("fraction", [-0.1, 1.5, 2, math.nan, math.inf, True, "0.5", [0.5]])
def test_fraction_outside_zero_to_one_raises(fraction):
    with pytest.raises(ValueError) as info:
        DistributedFusedAdam(_model().parameters(), offload="cpu", offload_fraction=fraction)
    assert str(info.value) == (
        f"offload_fraction={fraction!r}: expected a number from 0 to 1 (the share of each rank's owned state "
        "bytes kept in host memory, rounded to whole buckets; default 1.0)")


def test_param_remainders_with_offload_raise_saying_why():
    model = _model(torch.bfloat16)  # where remainders are valid without offload
    DistributedFusedAdam(model.parameters(), store_param_remainders=True)
    with pytest.raises(ValueError, match=r"store_param_remainders=True with offload='cpu': the host keeps the fp32 "
                                         r"master of the owned shard, so there is no master on the device to split"):
        DistributedFusedAdam(_model(torch.bfloat16).parameters(), store_param_remainders=True, offload="cpu")


def test_capturable_with_offload_raises():
    with pytest.raises(ValueError, match=r"capturable=True with offload='cpu': an offloaded step reads its grad "
                                         r"coefficient on the host .* which a CUDA graph cannot capture"):
        DistributedFusedAdam(_model().parameters(), capturable=True, offload="cpu", offload_fraction=0.0)


@pytest.mark.parametrize("fraction", [None, 0.0, 0.5, 1.0])
def test_offload_is_refused_as_not_available_before_any_state_moves(fraction):
    model = _model()
    before = [p.detach().clone() for p in model.parameters()]
    storages = [p.untyped_storage().data_ptr() for p in model.parameters()]
    with pytest.raises(NotImplementedError, match=r"^offload='cpu': optimizer state in host memory is not available "
                                                  r"yet .* pass offload=None \(the default\)"):
        DistributedFusedAdam(model.parameters(), offload="cpu", offload_fraction=fraction)
    # no flat buffers were made: the params are still their own tensors, unchanged
    assert [p.untyped_storage().data_ptr() for p in model.parameters()] == storages
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))
    DistributedFusedAdam(model.parameters())  # and they can still be given to an optimizer without offload
