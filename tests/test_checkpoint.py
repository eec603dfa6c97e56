"""Checkpoints: torch-layout state dicts and DCP sharded checkpoints, resharded across world
sizes and bucket layouts, against unsharded torch.optim.AdamW/Adam.

Two spawned gloo groups (world 3 trains and saves, world 2 resumes) share one temp dir; world 1
and torch.optim run in this process, without torch.distributed.
"""
from __future__ import annotations

import functools
import os
import tempfile
import warnings

import pytest
import torch

import cases_checkpoint as cc
from dist_helper import case_values, run_distributed
from parity import ATOL, RTOL, two_groups
from shardamp.optim.checkpoint import load_sharded


def _close(ours, ref, what: str = "") -> None:
    assert len(ours) == len(ref)
    for i, (a, b) in enumerate(zip(ours, ref)):
        torch.testing.assert_close(a, b, rtol=RTOL, atol=ATOL, msg=lambda m: f"{what} param {i}: {m}")


_ok = case_values


def _resume_here(saved, reference, what: str, named: bool = False, check_torch=None) -> None:
    """The model and optimizer state saved at world 3 resumed in this process and trained to the
    end, by a world-1 DistributedFusedAdam (another layout) and by torch.optim.AdamW (``named``:
    both over named params); each must end as the uninterrupted run. ``check_torch(topt)`` runs
    on the loaded torch optimizer before it trains."""
    model, opt = cc.build(bucket_cap_mb=cc.TINY, named=named)
    model.load_state_dict(saved["model"])
    opt.load_state_dict(saved["opt"])
    cc.train(model, opt, range(cc.SAVE_AT, cc.TOTAL))
    _close(cc.params_of(model), reference, f"{what}world 1")
    model = cc.new_model()
    model.load_state_dict(saved["model"])
    topt = torch.optim.AdamW((cc.named_two_groups if named else two_groups)(model))
    topt.load_state_dict(saved["opt"])
    if check_torch is not None:
        check_torch(topt)
    cc.train(model, topt, range(cc.SAVE_AT, cc.TOTAL))
    _close(cc.params_of(model), reference, f"{what}torch.optim.AdamW")


@functools.lru_cache(maxsize=None)
def _groups():
    tmp = tempfile.mkdtemp(prefix="shardamp-ckpt-")
    # torch.optim.Adam with L2 decay, 3 steps: its state dict is resumed by shardamp at world 2
    model, opt = cc.torch_run(steps=range(cc.SAVE_AT), cls=torch.optim.Adam, weight_decay=0.01)
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, os.path.join(tmp, "torch.pt"))
    w3 = run_distributed(cc.run, 3, tmp, cc.W3_CASES)
    _ok(w3, "case_save")  # world 2 needs what world 3 saved
    w2 = run_distributed(cc.run, 2, tmp, cc.W2_CASES)
    return tmp, w3, w2


@pytest.fixture(scope="module")
def groups():
    return _groups()


@pytest.fixture(scope="module")
def reference():
    model, _ = cc.torch_run()
    return cc.params_of(model)


def test_state_dict_matches_torch_layout(groups):
    """Every rank gets the same dict, in torch.optim.AdamW's layout and values."""
    _, w3, _ = groups
    saves = _ok(w3, "case_save")
    for other in saves[1:]:
        cc.assert_sd_equal(saves[0]["sd"], other["sd"])
    sd = saves[0]["sd"]
    _, ref = cc.torch_run(steps=range(cc.SAVE_AT))
    ref_sd = ref.state_dict()
    assert sd["param_groups"] == [dict(g) for g in ref_sd["param_groups"]]  # every key, torch's values
    assert sorted(sd["state"]) == sorted(ref_sd["state"])
    for i, entry in ref_sd["state"].items():
        assert sorted(sd["state"][i]) == sorted(entry)  # no master_param for an fp32 model
        assert sd["state"][i]["step"].dtype == torch.float32 and sd["state"][i]["step"].dim() == 0
        for k, t in entry.items():
            torch.testing.assert_close(sd["state"][i][k], t, rtol=RTOL, atol=ATOL, msg=lambda m: f"{i}.{k}: {m}")
    assert sd["shardamp"] == dict(adam_w_mode=True, bias_correction=True, max_grad_norm=None, dtype="float32")


def test_round_trip_is_bitwise(groups):
    _, w3, _ = groups
    assert all(_ok(w3, "case_roundtrip"))


def test_resume_at_world_2_equals_uninterrupted_run(groups, reference):
    _, _, w2 = groups
    for params in _ok(w2, "case_resume"):
        _close(params, reference, "world 2")


def test_resume_at_world_1_and_in_torch(groups, reference):
    tmp = groups[0]
    saved = torch.load(os.path.join(tmp, "w3.pt"), weights_only=True)

    def decoupled(topt):
        assert topt.param_groups[0]["decoupled_weight_decay"] is True

    _resume_here(saved, reference, "", check_torch=decoupled)


def test_dcp_saved_at_3_loads_at_2_and_1(groups, reference):
    tmp, w3, w2 = groups
    saved = _ok(w3, "case_save")[0]
    for value in _ok(w2, "case_dcp"):
        cc.assert_sd_equal(value["sd"], saved["sd"])
        assert value["scaler"] == saved["scaler"]
        _close(value["params"], reference, "dcp world 2")
    files = [f for f in os.listdir(os.path.join(tmp, "dcp")) if f.endswith(".distcp")]
    assert len(files) == 3  # one shard file per rank
    w3_model = torch.load(os.path.join(tmp, "w3.pt"), weights_only=True)["model"]
    model, opt = cc.build(bucket_cap_mb=1000.0)
    model.load_state_dict(w3_model)
    load_sharded(opt, os.path.join(tmp, "dcp"))
    cc.assert_sd_equal(opt.state_dict(), saved["sd"])


def test_bf16_master_survives_exactly(groups):
    _, w3, w2 = groups
    saves = _ok(w3, "case_bf16")
    sd = saves[0]["sd"]
    assert any("master weights" in w for w in saves[0]["warnings"]), saves[0]["warnings"]
    for i, entry in sd["state"].items():
        assert entry["master_param"].dtype == torch.float32 and entry["exp_avg"].dtype == torch.float32
    model_params = saves[0]["model"]
    assert any(not torch.equal(e["master_param"], p.float()) for e, p in zip(sd["state"].values(), model_params))
    for value in _ok(w2, "case_bf16_resume"):
        cc.assert_sd_equal(value["sd"], sd)


def test_channels_last(groups):
    _, w3, w2 = groups
    sd = _ok(w3, "case_channels_last")[0]["sd"]
    four_d = [e for e in sd["state"].values() if e["exp_avg"].dim() == 4]
    assert four_d and all(e[k].is_contiguous(memory_format=torch.channels_last) for e in four_d for k in ("exp_avg", "exp_avg_sq"))
    model, _ = cc.torch_run("conv", channels_last=True)
    for value in _ok(w2, "case_channels_last_resume"):
        cc.assert_sd_equal(value["sd"], sd)
        assert all(value["channels_last"])
        _close(value["params"], cc.params_of(model), "channels_last world 2")


def test_mismatched_state_dicts_raise_and_change_nothing(groups):
    _, w3, _ = groups
    messages = _ok(w3, "case_errors")[0]
    assert len(messages) == len(cc._mutations(torch.load(os.path.join(groups[0], "w3.pt"), weights_only=True)["opt"])) + 1


def test_torch_state_dict_into_shardamp_continues_like_torch(groups):
    tmp, _, w2 = groups
    model, _ = cc.torch_run(cls=torch.optim.Adam, weight_decay=0.01)  # torch continuing = 6 steps
    expected = cc.params_of(model)
    for params in _ok(w2, "case_from_torch"):
        _close(params, expected, "torch Adam -> world 2")
    saved = torch.load(os.path.join(tmp, "torch.pt"), weights_only=True)
    model, opt = cc.build()
    model.load_state_dict(saved["model"])
    with pytest.warns(UserWarning, match="adam_w_mode=False"):
        opt.load_state_dict(saved["opt"])
    cc.train(model, opt, range(cc.SAVE_AT, cc.TOTAL))
    _close(cc.params_of(model), expected, "torch Adam -> world 1")


def test_options_loaded_after_steps_take_effect(groups):
    """A state dict loaded after steps that switches adam_w_mode (torch Adam's: L2 decay) trains
    as torch continuing: the step launches built at the first step take the loaded option."""
    tmp, _, _ = groups
    model, _ = cc.torch_run(cls=torch.optim.Adam, weight_decay=0.01)
    expected = cc.params_of(model)
    saved = torch.load(os.path.join(tmp, "torch.pt"), weights_only=True)
    model, opt = cc.build()
    cc.train(model, opt, range(2))  # the launches exist, built for AdamW
    model.load_state_dict(saved["model"])
    with pytest.warns(UserWarning, match="adam_w_mode=False"):
        opt.load_state_dict(saved["opt"])
    cc.train(model, opt, range(cc.SAVE_AT, cc.TOTAL))
    _close(cc.params_of(model), expected, "torch Adam -> after AdamW steps")


def test_state_dict_warns_what_torch_cannot_load():
    model, opt = cc.build(bias_correction=False, max_grad_norm=1.0)
    cc.train(model, opt, range(1))
    with pytest.warns(UserWarning, match="bias_correction=False.*max_grad_norm=1.0"):
        sd = opt.state_dict()
    assert sd["shardamp"]["bias_correction"] is False and sd["shardamp"]["max_grad_norm"] == 1.0
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        opt.state_dict()  # once per optimizer
    model2, opt2 = cc.build()
    opt2.load_state_dict(sd)
    assert (opt2.bias_correction, opt2.max_grad_norm) == (False, 1.0)


def test_dcp_bf16_master_and_layout_change(tmp_path):
    """In one process: a bf16 model's fp32 master goes through DCP exactly, across layouts."""
    model, opt = cc.build(dtype=torch.bfloat16, bucket_cap_mb=cc.TINY)
    cc.train(model, opt, range(2))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the master weights cannot go to torch: warned, by design
        expected = opt.state_dict()
    from shardamp.optim.checkpoint import save_sharded

    save_sharded(opt, tmp_path / "ckpt")
    model2, opt2 = cc.build(dtype=torch.bfloat16, bucket_cap_mb=1000.0)
    model2.load_state_dict(model.state_dict())
    load_sharded(opt2, tmp_path / "ckpt")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cc.assert_sd_equal(opt2.state_dict(), expected)


def test_named_params_state_dicts_across_worlds_and_torch(groups, reference):
    """named_parameters() groups: the state dict saved at world 3 has torch.optim.AdamW's own
    param_groups, names included; world 2 loads it (another layout) and trains on like the
    uninterrupted run; an unnamed optimizer loading it takes its names and a DCP checkpoint keeps
    them (torch's rules); world 1 and torch.optim.AdamW over named params load it too."""
    tmp, w3, w2 = groups
    sd = _ok(w3, "case_save_named")[0]["sd"]
    _, ref = cc.torch_run(steps=range(cc.SAVE_AT), named=True)
    assert sd["param_groups"] == [dict(g) for g in ref.state_dict()["param_groups"]]
    assert sd["param_groups"][0]["param_names"] == ["a.weight", "a.bias"]
    for value in _ok(w2, "case_resume_named"):
        assert value["names_taken"] == [g["param_names"] for g in sd["param_groups"]]
        assert value["dcp_sd"]["param_groups"] == sd["param_groups"]
        assert value["sd"]["param_groups"] == sd["param_groups"]
        _close(value["params"], reference, "named, world 2")
    saved = torch.load(os.path.join(tmp, "named.pt"), weights_only=True)
    _resume_here(saved, reference, "named, ", named=True)

