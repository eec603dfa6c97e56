"""Storage options: bf16 moments (exp_avg_dtype / exp_avg_sq_dtype) and param remainders
(store_param_remainders): validation, state dicts and DCP checkpoints across world sizes and
layouts, torch.optim interop. (Training parity and memory: test_core.py; kernels: test_kernels_light_state.py.)
"""
from __future__ import annotations

import functools
import os
import tempfile
import warnings

import pytest
import torch

import cases_checkpoint as cc
import cases_state_dtypes as cs
from dist_helper import case_values, run_distributed
from parity import two_groups
from shardamp.optim import DistributedFusedAdam
from shardamp.optim.checkpoint import load_sharded
from shardamp.optim.kernels.reference import split_remainders


@functools.lru_cache(maxsize=None)
def _groups():
    tmp = tempfile.mkdtemp(prefix="shardamp-dtypes-")
    w3 = run_distributed(cs.run, 3, tmp, cs.W3_CASES)
    saves = case_values(w3, "case_save")
    w2 = run_distributed(cs.run, 2, tmp, cs.W2_CASES)
    return tmp, saves, case_values(w2, "case_resume")


@pytest.fixture(scope="module")
def groups():
    return _groups()


def _quiet_sd(opt):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # what torch cannot load: warned, tested below
        return opt.state_dict()


@pytest.mark.parametrize("name", list(cs.CONFIGS))
def test_checkpoints_round_trip_bitwise_across_worlds(groups, name):
    """Saved at world 3; loaded at world 2 (state dict and DCP, other layouts) and at world 1:
    the state dicts are bitwise the saved one, every rank holds the same model, and the resumed
    run follows the uninterrupted one."""
    tmp, saves, resumes = groups
    saved = saves[0][name]
    for other in saves[1:]:
        cc.assert_sd_equal(other[name]["sd"], saved["sd"])
    dtype, opts = cs.CONFIGS[name]
    entry = next(iter(saved["sd"]["state"].values()))
    moments = opts.get("exp_avg_dtype", torch.float32)
    assert entry["exp_avg"].dtype == entry["exp_avg_sq"].dtype == moments
    assert ("master_param" in entry) == (dtype == torch.bfloat16)
    for value in resumes:
        cc.assert_sd_equal(value[name]["sd"], saved["sd"])
        cc.assert_sd_equal(value[name]["dcp_sd"], saved["sd"])
        for a, b in zip(value[name]["dcp_model"], resumes[0][name]["dcp_model"]):
            assert torch.equal(a, b)  # every rank: the same model after a sharded load
        # fp32 models: round-off only; bf16 models: a bf16 ulp or two where a sum in another order
        # (another world size) rounds the other way
        rtol, atol = (1e-5, 1e-6) if dtype == torch.float32 else (1e-2, 1e-3)
        for p, ref in zip(value[name]["params"], saved["final"]):
            torch.testing.assert_close(p.float(), ref.float(), rtol=rtol, atol=atol)
    if opts.get("store_param_remainders"):  # the loaded model is the masters' high halves
        masters = [e["master_param"] for e in saved["sd"]["state"].values()]
        for p, m in zip(resumes[0][name]["dcp_model"], masters):
            assert torch.equal(p.view(torch.int16), split_remainders(m.contiguous())[0].view(torch.int16))
    model, opt = cs._build(name, cc.TINY)  # world 1, in this process
    model.load_state_dict(torch.load(os.path.join(tmp, f"{name}.pt"), weights_only=True)["model"])
    load_sharded(opt, os.path.join(tmp, f"dcp_{name}"))
    cc.assert_sd_equal(_quiet_sd(opt), saved["sd"])


def test_remainders_and_separate_master_load_each_other_exactly(groups):
    _, _, resumes = groups
    assert all(all(v["cross"]) and len(v["cross"]) == 2 for v in resumes)


def test_torch_adamw_loads_bf16_moments_upcast_with_a_warning():
    model, opt = cc.build(**cs.BF16)
    cc.train(model, opt, range(2))
    with pytest.warns(UserWarning, match="bfloat16 storage of exp_avg and exp_avg_sq"):
        sd = opt.state_dict()
    assert sd["shardamp"]["exp_avg_dtype"] == "bfloat16"
    tmodel = cc.new_model()
    tmodel.load_state_dict(model.state_dict())
    topt = torch.optim.AdamW(two_groups(tmodel))
    topt.load_state_dict(sd)
    for i, p in enumerate(tmodel.parameters()):
        state = topt.state[p]
        assert state["exp_avg"].dtype == torch.float32  # upcast, exactly
        assert torch.equal(state["exp_avg"], sd["state"][i]["exp_avg"].float())


def test_torch_fp32_state_into_bf16_moments_rounds_to_nearest_even():
    tmodel, topt = cc.torch_run(steps=range(2))
    tsd = topt.state_dict()
    model, opt = cc.build(**cs.BF16)
    model.load_state_dict(tmodel.state_dict())
    opt.load_state_dict(tsd)
    sd = _quiet_sd(opt)
    for i, entry in tsd["state"].items():
        for k in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(sd["state"][i][k], entry[k].to(torch.bfloat16)), (i, k)
    cc.train(model, opt, range(2, 4))  # and trains on


def test_defaults_keep_fp32_moments_and_no_remainders():
    model, opt = cc.build()
    assert opt.exp_avg_dtype == opt.exp_avg_sq_dtype == torch.float32 and not opt.store_param_remainders
    assert all(b.exp_avg.dtype == torch.float32 and not b.remainders for b in opt._buffers)
    cc.train(model, opt, range(1))
    assert set(opt.state_dict()["shardamp"]) == {"adam_w_mode", "bias_correction", "max_grad_norm", "dtype"}
    opt = DistributedFusedAdam(cc.new_model(dtype=torch.float64).parameters(), dtype=torch.float64)
    assert opt._buffers[0].exp_avg.dtype == torch.float64  # None follows the state dtype


@pytest.mark.parametrize("kwargs,match", [
    (dict(exp_avg_dtype=torch.float16), "exp_avg_dtype=torch.float16"),
    (dict(exp_avg_sq_dtype="bf16"), "exp_avg_sq_dtype='bf16'"),
    (dict(store_param_remainders=1), "store_param_remainders=1: expected True or False"),
    (dict(store_param_remainders=True), "needs bfloat16 params.*no bfloat16 params"),
    (dict(store_param_remainders=True, model=torch.float16), "needs bfloat16 params.*float16"),
    (dict(store_param_remainders=True, model=torch.bfloat16, dtype=torch.float64), "needs dtype=torch.float32"),
    (dict(store_param_remainders=True, model=torch.bfloat16, param_sync_dtype=torch.float32),
     "needs param_sync_dtype None or torch.bfloat16"),
])
def test_invalid_storage_options_raise(kwargs, match):
    dtype = kwargs.pop("model", torch.float32)
    model = cc.new_model(dtype=dtype)
    with pytest.raises(ValueError, match=match):
        DistributedFusedAdam(model.parameters(), **kwargs)
