"""Blockwise moments ("8bit" / "4bit") end to end on the CPU: bitwise the same states and params
at world 1, 2 and 4 (uneven shards, several groups and buckets, an untouched param, bf16 params
with remainders); resumes across world sizes and layouts, bitwise; a loop with a scaler,
max_grad_norm and an inf on one rank against torch's loop over the reference math; state dicts
torch loads (to_torch_state_dict) and torch's fp32 moments loaded by quantizing; memory_stats;
ranks with different formats; the zero-code rule through the optimizer; capturable, spike skips,
Adam, no bias correction and channels_last over low-bit moments. (The math alone: test_quant.py,
test_quant_step.py.)"""
from __future__ import annotations

import functools
import tempfile
import warnings

import pytest
import torch

import cases_checkpoint as cc
import cases_low_bit as cl
from dist_helper import case_values, run_distributed
from low_bit_reference import ReferenceLowBitAdamW
from parity import two_groups
from shardamp.optim import DistributedFusedAdam, state_formats as sf, to_torch_state_dict
from shardamp.optim.kernels import quant


@functools.lru_cache(maxsize=None)
def _groups():
    tmp = tempfile.mkdtemp(prefix="shardamp-lowbit-")
    w4 = run_distributed(cl.run, 4, tmp, cl.W4_CASES)
    w2 = run_distributed(cl.run, 2, tmp, cl.W2_CASES)
    w1 = run_distributed(cl.run, 1, tmp, cl.W1_CASES)
    return {4: w4, 2: w2, 1: w1}


@pytest.fixture(scope="module")
def groups():
    return _groups()


@pytest.mark.parametrize("name", list(cl.CONFIGS))
def test_states_and_params_bitwise_the_same_at_world_1_2_4(groups, name):
    ref = case_values(groups[1], "case_steps")[0][name]
    for world in (2, 4):
        for value in case_values(groups[world], "case_steps"):  # every rank
            got = value[name]
            assert cl.sd_equal(got["mid"], ref["mid"]) == "", world
            assert cl.sd_equal(got["final_sd"], ref["final_sd"]) == "", world
            for a, b in zip(got["final"], ref["final"]):
                assert torch.equal(a, b), world
    # the untouched param kept its moments on the odd steps; every param trained
    entry = next(iter(ref["final_sd"]["state"].values()))
    formats = cl.CONFIGS[name][1]
    for key in ("exp_avg", "exp_avg_sq"):
        if formats.get(f"{key}_dtype") in ("8bit", "4bit"):
            assert entry[key].dtype == torch.uint8 and entry[f"{key}_scales"].dtype == torch.float32
    init = cc.params_of(cc.new_model(dtype=cl.CONFIGS[name][0]))
    assert all(not torch.equal(a, b) for a, b in zip(ref["final"], init))


@pytest.mark.parametrize("name", list(cl.CONFIGS))
def test_resume_across_world_sizes_bitwise_and_across_layouts(groups, name):
    """Saved at world 4; loaded at worlds 2 and 1. In the same bucket layout (a state dict, a
    DCP checkpoint) the state dicts are bitwise the saved one and training goes on bitwise as the
    uninterrupted run did. In other layouts (other block offsets) the moments are requantized:
    one rounding, within the formats' round-trip error, and training goes on."""
    saved = case_values(groups[4], "case_steps")[0][name]
    saved_fp32 = to_torch_state_dict(saved["mid"])
    formats = cl.CONFIGS[name][1]
    for world in (1, 2):
        for value in case_values(groups[world], "case_resume"):
            got = value[name]
            for how in ("sd", "dcp"):
                assert cl.sd_equal(got[how], saved["mid"]) == "", (world, how)
                for a, c in zip(got[how + "_final"], saved["final"]):
                    assert torch.equal(a, c), (world, how)
            for how in ("sd_other", "dcp_other"):
                other = to_torch_state_dict(got[how])
                for i, entry in other["state"].items():
                    for key in ("exp_avg", "exp_avg_sq"):
                        # within about a code step of the block's absmax (>= the param's largest):
                        # measured up to 0.016 at 8 bits and 0.195 at 4 bits on this model
                        tol = {"8bit": 0.03, "4bit": 0.3}.get(formats.get(f"{key}_dtype"), 0.0)
                        a, b = entry[key].float(), saved_fp32["state"][i][key].float()
                        assert (a - b).abs().max() <= tol * b.abs().max(), (world, how, i, key)
                # trains on: Adam moves an element about lr per step at most (3 steps at lr <= 2e-2
                # here); a requantized moment tips the updates of some of the smallest second
                # moments (a few elements by up to 0.022 at 4 bits), the rest stay close
                budget = 3 * 2e-2
                diffs = torch.cat([(a.float() - c.float()).abs().reshape(-1)
                                   for a, c in zip(got[how + "_final"], saved["final"])])
                assert diffs.max() <= budget and diffs.mean() <= 0.05 * budget, (world, how, diffs.max(), diffs.mean())
            # into fp32 moments: the saved codes dequantized, as to_torch_state_dict gives them
            for i, entry in got["as_fp32"]["state"].items():
                for key in ("exp_avg", "exp_avg_sq"):
                    assert torch.equal(entry[key], saved_fp32["state"][i][key].to(entry[key].dtype)), (world, i, key)


def test_ranks_ran_the_compiled_blockwise_step(groups):
    """Where the CPU kernels build here, every rank's steps above took the compiled blockwise step
    (bitwise the reference: test_quant_step.py), not the reference math."""
    from shardamp.optim import kernels

    if kernels.backend(torch.device("cpu")) != "native":
        pytest.skip("the CPU kernels did not build here: the ranks ran the reference math")
    for world in (1, 2, 4):
        for value in case_values(groups[world], "case_steps"):
            assert {v["backend"] for v in value.values()} == {"native"}, world


def test_memory_stats_count_codes_and_scales(groups):
    for world in (1, 2, 4):
        for value in case_values(groups[world], "case_steps"):
            for name, (_, opts) in cl.CONFIGS.items():
                got = value[name]
                block = opts.get("quant_block_size")
                per = 0.0
                for key in ("exp_avg_dtype", "exp_avg_sq_dtype"):
                    fmt = {"8bit": sf.Q8, "4bit": sf.Q4, None: sf.FP32}[opts.get(key)]
                    b = block or fmt.block_size
                    per += fmt.bits / 8 + (4 / b if fmt.blockwise else 0)
                assert got["moments_bytes"] == got["shard"] * per, (world, name)


def test_ranks_with_different_formats_fail_on_every_rank(groups):
    for text in case_values(groups[2], "case_mixed_formats"):
        assert "built different optimizers" in text and "exp_avg_dtype" in text, text
        assert "rank 0: {'exp_avg': '8bit (block 256)'" in text and "rank 1: {'exp_avg': '4bit (block 128)'" in text


@pytest.mark.parametrize("name", ["q8_q4", "q4"])
def test_scaler_and_max_grad_norm_loop_against_the_reference_math(groups, name):
    """World 2 with ShardedGradScaler, max_grad_norm and an inf on one rank at step 2, against
    torch's GradScaler + clip_grad_norm_ over the reference math on whole batches: the same
    skipped step and scales; params equal to fp32 round-off of the norm (another summation
    order) and what a code it tips over to the neighbouring one moves."""
    model = cc.new_model()
    opts = cl.CONFIGS[name][1]
    opt = ReferenceLowBitAdamW(two_groups(model), opts["exp_avg_dtype"], opts["exp_avg_sq_dtype"], cc.TINY)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8, growth_interval=2)
    ranks = case_values(groups[2], "case_scaler_clip")
    for step in range(cl.TOTAL):
        x, y = cc.batch(step)
        # the sharded run's loss is each rank's mean over its half: their average is this mean
        loss = torch.nn.functional.mse_loss(model(x), y)
        if step == 2:
            loss = loss * float("inf")
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        params = cc.params_of(model)
        for value in ranks:
            got = value[name]["steps"][step]
            assert got["scale"] == scaler.get_scale(), step
            for k, (a, b) in enumerate(zip(got["params"], params)):
                if step == 2:  # skipped: bitwise unchanged on every rank
                    assert torch.equal(a, value[name]["steps"][1]["params"][k])
                torch.testing.assert_close(a, b, rtol=1e-4, atol=2e-5)


def test_to_torch_state_dict_is_what_torch_adamw_loads_and_identity_otherwise():
    model, opt = cc.build(exp_avg_dtype="8bit", exp_avg_sq_dtype="4bit", bucket_cap_mb=cc.TINY)
    cl.train_exact(model, opt, range(2))
    with pytest.warns(UserWarning, match="8bit codes and block scales of exp_avg.*to_torch_state_dict"):
        sd = opt.state_dict()
    snapshot = {i: {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in e.items()}
                for i, e in sd["state"].items()}
    tsd = to_torch_state_dict(sd)
    assert cl.sd_equal(sd, {**sd, "state": snapshot}) == ""  # the input is not modified
    assert set(tsd["shardamp"]) == set(sd["shardamp"]) - {"exp_avg_quant", "exp_avg_sq_quant"}
    tmodel = cc.new_model()
    tmodel.load_state_dict(model.state_dict())
    topt = torch.optim.AdamW(two_groups(tmodel))
    topt.load_state_dict(tsd)
    for i, p in enumerate(tmodel.parameters()):
        state = topt.state[p]
        assert set(state) == {"step", "exp_avg", "exp_avg_sq"}
        assert state["exp_avg"].dtype == torch.float32 and state["exp_avg"].shape == p.shape
        e = sd["state"][i]
        # the codes dequantized: map[code] * the scale of the code's block
        qmap = quant.code_map("dynamic_sym", 8, True)
        off = e["exp_avg_block_offset"]
        scales = e["exp_avg_scales"].repeat_interleave(256)[off:off + p.numel()]
        assert torch.equal(state["exp_avg"].reshape(-1), qmap[e["exp_avg"].long()] * scales)
        assert (state["exp_avg_sq"] > 0).all()  # the zero-code rule, through the state dict
    topt.step()  # and torch trains on from them
    # fp32 / bf16 state dicts, and torch's own: the identity
    fmodel, fopt = cc.build(exp_avg_dtype=torch.bfloat16)
    cl.train_exact(fmodel, fopt, range(1))
    fsd = cl.quiet_sd(fopt)
    assert to_torch_state_dict(fsd) is fsd and to_torch_state_dict(topt.state_dict()) is not None


def test_torch_fp32_moments_load_into_low_bit_by_quantizing():
    tmodel, topt = cc.torch_run(steps=range(2))
    tsd = topt.state_dict()
    model, opt = cc.build(exp_avg_dtype="4bit", exp_avg_sq_dtype="8bit", bucket_cap_mb=cc.TINY)
    model.load_state_dict(tmodel.state_dict())
    opt.load_state_dict(tsd)
    back = to_torch_state_dict(cl.quiet_sd(opt))
    for i, entry in tsd["state"].items():
        for key, tol in (("exp_avg", 0.2), ("exp_avg_sq", 0.02)):
            a, b = back["state"][i][key], entry[key]
            assert a.shape == b.shape and a.stride() == b.stride()
            assert (a - b).norm() <= tol * b.norm(), (i, key)
    cc.train(model, opt, range(2, 4))  # and trains on


@pytest.mark.parametrize("mutate,match", [
    (lambda sd: sd["state"][0].pop("exp_avg_scales"), "'exp_avg' must be a floating-point tensor"),
    (lambda sd: sd["shardamp"].pop("exp_avg_quant"), "no 'exp_avg_quant' saying how they read"),
    (lambda sd: sd["state"][0].__setitem__("exp_avg", sd["state"][0]["exp_avg"][:-1]), "'exp_avg' must be 240 uint8"),
    (lambda sd: sd["state"][0]["exp_avg_sq_scales"].__setitem__(0, -1.0), "non-finite or negative scales"),
    (lambda sd: sd["state"][0].__setitem__("exp_avg_block_offset", 300), r"expected an int in \[0, 256\)"),
    (lambda sd: sd["state"][0].pop("param_layout"), "no 'param_layout'"),
])
def test_bad_low_bit_state_dicts_raise_naming_the_entry(mutate, match):
    model, opt = cc.build(exp_avg_dtype="8bit", exp_avg_sq_dtype="4bit")
    cl.train_exact(model, opt, range(1))
    sd = cl.quiet_sd(opt)
    mutate(sd)
    _, opt2 = cc.build(exp_avg_dtype="8bit", exp_avg_sq_dtype="4bit")
    with pytest.raises(ValueError, match=match):
        opt2.load_state_dict(sd)


def test_cuda_params_without_the_kernel_are_refused_naming_the_fix(monkeypatch):
    """CUDA params with a blockwise format need the compiled CUDA kernel: without it (no CUDA build,
    or one that predates it) construction raises naming the formats and the fixes; with it, blocks
    larger than its tile raise naming quant_block_size."""
    from shardamp.optim import distributed_fused_adam as dfa

    monkeypatch.setattr(dfa, "params_device", lambda params: torch.device("cuda", 0))
    monkeypatch.setattr(dfa.kernels, "backend", lambda device: "reference")
    monkeypatch.setattr(dfa.kernels, "native_module", lambda device: None)
    with pytest.raises(NotImplementedError, match="exp_avg_dtype='8bit'.*adam_step_blockwise.*no CUDA kernels.*"
                                                  "torch.bfloat16.*SHARDAMP_KERNELS=reference"):
        DistributedFusedAdam(cc.new_model().parameters(), exp_avg_dtype="8bit")

    class Old:  # a CUDA module built before the blockwise kernel
        pass

    monkeypatch.setattr(dfa.kernels, "native_module", lambda device: Old())
    with pytest.raises(NotImplementedError, match="exp_avg_sq_dtype='4bit'.*predate it"):
        DistributedFusedAdam(cc.new_model().parameters(), exp_avg_sq_dtype="4bit")

    class WithKernel:
        BLOCKWISE_CUDA_TILE = 2048

        def adam_step_blockwise(self, *args):
            raise AssertionError("not reached")

    monkeypatch.setattr(dfa.kernels, "native_module", lambda device: WithKernel())
    with pytest.raises(ValueError, match="quant_block_size=4096.*at most 2048 elements"):
        DistributedFusedAdam(cc.new_model().parameters(), exp_avg_dtype="8bit", quant_block_size=4096)


@pytest.mark.parametrize("fmt", ["4bit", "8bit"])
def test_zero_code_rule_through_the_optimizer(fmt):
    """One grad 1e6 times its neighbours' in every block: their second moments sit far below a
    code step of the block's absmax, yet none is stored as 0 (the state dict says so), and no
    element moves by more than lr per step (a zero second moment would divide by eps alone)."""
    lr = 1e-3
    p = torch.nn.Parameter(torch.zeros(4, 256))
    opt = DistributedFusedAdam([p], lr=lr, exp_avg_dtype=fmt, exp_avg_sq_dtype=fmt)
    g = torch.full((4, 256), 1e-3)
    g[:, 0] = 1e3
    for _ in range(10):
        before = p.detach().clone()
        (p * g).sum().backward()
        opt.step()
        opt.zero_grad()
        assert (p.detach() - before).abs().max() <= 1.01 * lr
    state = to_torch_state_dict(cl.quiet_sd(opt))["state"][0]
    assert (state["exp_avg_sq"] > 0).all() and (p.detach() < 0).all()


@pytest.mark.parametrize("options", [dict(capturable=True), dict(skip_grad_norm_above=10.0),
                                     dict(max_grad_norm=0.1, adam_w_mode=False), dict(bias_correction=False)])
def test_other_options_run_with_low_bit_moments(options):
    """The step's other options over blockwise moments, at world 1, against the same options
    with fp32 moments: the params move alike (within what the moments' rounding changes)."""
    runs = []
    for formats in (dict(exp_avg_dtype="8bit", exp_avg_sq_dtype="8bit"), {}):
        model, opt = cc.build(bucket_cap_mb=cc.TINY, **options, **formats)
        cc.train(model, opt, range(4))
        runs.append(cc.params_of(model))
    init = cc.params_of(cc.new_model())
    for a, b, p0 in zip(*runs, init):
        moved = (b - p0).abs().max()
        assert moved > 0 and (a - b).abs().max() <= 0.1 * moved


def test_channels_last_params_keep_their_memory_format():
    model, opt = cc.build(kind="conv", channels_last=True, exp_avg_dtype="4bit", exp_avg_sq_dtype="8bit")
    cc.train(model, opt, range(2), kind="conv")
    sd = cl.quiet_sd(opt)
    tsd = to_torch_state_dict(sd)
    for p, (i, entry) in zip(model.parameters(), sorted(tsd["state"].items())):
        assert entry["exp_avg"].shape == p.shape and entry["exp_avg"].stride() == p.stride(), i
        assert sd["state"][i]["param_layout"] == {"shape": list(p.shape), "stride": list(p.stride())}
    model2, opt2 = cc.build(kind="conv", channels_last=True, exp_avg_dtype="4bit", exp_avg_sq_dtype="8bit")
    model2.load_state_dict(model.state_dict())
    opt2.load_state_dict(sd)
    assert cl.sd_equal(cl.quiet_sd(opt2), sd) == ""  # the same layout: bitwise
