"""Hybrid sharding over a DeviceMesh (tests/cases_mesh.py): 4 gloo ranks as 1x4, 2x2, 4x1 and a
1-D mesh of 4, each against unsharded torch fed all 4 ranks' batches; checkpoints saved on 2x2
load on every other shape and at world 1; ``offload="cpu"`` on 2x2 bitwise the run without it."""
from __future__ import annotations

import functools
import os
import tempfile

import pytest
import torch

import cases_checkpoint as cc
import cases_mesh as cm
from dist_helper import case_values, run_distributed
from parity import ATOL, RTOL, two_groups
from shardamp.optim import DistributedFusedAdam
from shardamp.optim.checkpoint import load_sharded
from test_core import check_parity_case
from test_scaler_loops import check_group_norms, check_loop_case

SHAPES = [cm.shape_name(s) for s in cm.SHAPES]


@functools.lru_cache(maxsize=None)
def _results():
    tmp = tempfile.mkdtemp(prefix="shardamp-mesh-")
    return tmp, run_distributed(cm.run, cm.WORLD, tmp, timeout=900.0)


def _case(name: str):
    return case_values(_results()[1], name)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("case", ["case_parity", "case_parity_sum_micro", "case_parity_reduce_each_micro",
                                  "case_parity_capturable_no_overlap", "case_parity_low_bit"])
def test_mesh_parity_with_torch_adamw(shape: str, case: str) -> None:
    check_parity_case(_results()[1], f"{case}[{shape}]")


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("loop", cm.LOOPS)
def test_mesh_amp_loops_match_torch(shape: str, loop: str) -> None:
    per_rank = [{f"case_loop_{loop}": ("ok", value[loop])} for value in _case(f"case_loops[{shape}]")]
    check_loop_case(per_rank, f"case_loop_{loop}")


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("loop", cm.LOW_BIT_LOOPS)
def test_mesh_amp_loops_with_low_bit_moments_match_the_quantized_reference(shape: str, loop: str) -> None:
    per_rank = [{f"case_loop_{loop}": ("ok", value[loop])} for value in _case(f"case_loops_low_bit[{shape}]")]
    check_loop_case(per_rank, f"case_loop_{loop}")


@pytest.mark.parametrize("shape", SHAPES)
def test_mesh_grad_norms_by_group_match_torch(shape: str) -> None:
    check_group_norms(_case(f"case_group_norms[{shape}]"))


@pytest.mark.parametrize("shape", SHAPES)
def test_mesh_one_stats_all_reduce_per_step(shape: str) -> None:
    for value in _case(f"case_collectives[{shape}]"):
        replicate, shard = value["replicate"], value["shard"]
        assert replicate * shard == cm.WORLD
        assert (replicate, shard) == {"1x4": (1, 4), "2x2": (2, 2), "4x1": (4, 1), "1d4": (1, 4)}[shape]
        for step in value["per_step"]:
            assert step["stats"] == 1, value
            # one all-reduce per bucket over the replicas, none without replicas
            assert step["replicas"] == (value["buckets"] if replicate > 1 else 0), value
        assert value["hook_calls"] == len(value["per_step"])  # the subclass hook ran every step


@pytest.mark.parametrize("shape", SHAPES)
def test_mesh_state_lives_on_the_shard_dim(shape: str) -> None:
    for value in _case(f"case_memory[{shape}]"):
        shard = value["shard"]
        assert value["bucket_numel"] == shard * value["shard_numel"]
        assert value["moments"] == 8 * value["shard_numel"]  # fp32 exp_avg + exp_avg_sq
        # padding aside (a multiple of 16 per param and per shard), 1 / shard of the params
        assert value["n"] / shard <= value["shard_numel"] <= value["n"] / shard + 16 * 8


@pytest.mark.parametrize("shape", SHAPES)
def test_mesh_norm_types(shape: str) -> None:
    for value in _case(f"case_norm_types[{shape}]"):
        for ours, ref in zip(value["ours"], value["ref"]):
            for a, b in zip(ours, ref):
                assert a == pytest.approx(b, rel=1e-4)
        for a, b in zip(value["params"], value["ref_params"]):
            torch.testing.assert_close(a, b, rtol=RTOL, atol=ATOL)


def test_process_group_and_device_mesh_exclude_each_other() -> None:
    model = torch.nn.Linear(3, 2)
    with pytest.raises(ValueError, match="process_group and device_mesh were both given"):
        DistributedFusedAdam(model.parameters(), process_group=object(), device_mesh=object())


def test_device_mesh_without_distributed_is_refused() -> None:
    model = torch.nn.Linear(3, 2)
    with pytest.raises(ValueError, match="device_mesh was given but torch.distributed is not initialised"):
        DistributedFusedAdam(model.parameters(), device_mesh=object())


def _checkpoint():
    return case_values(_results()[1], "checkpoint")


@pytest.mark.parametrize("low_bit", [False, True])
def test_mesh_checkpoints_reshard_across_mesh_shapes(low_bit: bool) -> None:
    """Saved on 2x2: the state dict is the same on every rank; loaded (state dict or DCP) on
    1x4, 4x1 and 1-D, the state dicts are bitwise the saved one and the resumed runs follow the
    uninterrupted one (and torch's; with blockwise moments, the same quantized math unsharded)."""
    values = [v["low_bit"] for v in _checkpoint()] if low_bit else _checkpoint()
    saved = values[0]["saved_sd"]
    ref_model, _ = (_low_bit_reference_run() if low_bit else cc.torch_run(per_step=cm.PER_STEP))
    cc.assert_sd_equal(values[0]["rank0_only"], saved)
    assert all(value["rank0_only"] is None for value in values[1:])
    if low_bit:
        assert next(iter(saved["state"].values()))["exp_avg"].dtype == torch.uint8
    for value in values:
        cc.assert_sd_equal(value["saved_sd"], saved)
        for a, b in zip(value["final"], ref_model.parameters()):
            torch.testing.assert_close(a, b.detach(), rtol=RTOL, atol=ATOL)
        for shape in ("1x4", "4x1", "1d4"):
            for how in ("sd", "dcp"):
                got = value[shape][how]
                cc.assert_sd_equal(got["sd"], saved)
                for a, b in zip(got["final"], value["final"]):
                    torch.testing.assert_close(a, b, rtol=RTOL, atol=ATOL)


def test_mesh_offload_is_bitwise_the_state_on_the_params_device() -> None:
    """offload="cpu" on the 2x2 mesh (shard inside each replica, replicate across): loops A-G over
    fp32 / bf16 params, bf16 and blockwise moments, half the buckets offloaded, each bitwise the
    same run without offload (cases_mesh.offload_cases; the checks of test_offload.py)."""
    from test_offload import check_offloaded_loop

    values = case_values(_results()[1], "offload")
    assert len(values) == cm.WORLD
    for rank, value in enumerate(values):
        assert sorted(value) == sorted(cm.OFFLOAD_CASES)
        for (config, loop), runs in value.items():
            check_offloaded_loop(config, loop, runs, ("2x2", rank))
    assert {loop for _, loop in cm.OFFLOAD_CASES} == set("ABCDEFG")


def _low_bit_reference_run():
    """cases_checkpoint.torch_run's training with the unsharded quantized reference (the mesh
    run's formats and buckets) in place of torch.optim.AdamW."""
    from low_bit_reference import ReferenceLowBitAdamW

    model = cc.new_model()
    opt = ReferenceLowBitAdamW(two_groups(model), cm.LOW_BIT_CKPT["exp_avg_dtype"],
                               cm.LOW_BIT_CKPT["exp_avg_sq_dtype"], cc.TINY)
    cc.train(model, opt, range(cc.TOTAL), per_step=cm.PER_STEP)
    return model, opt


@pytest.mark.parametrize("low_bit", [False, True])
def test_mesh_checkpoint_loads_at_world_1(low_bit: bool) -> None:
    tmp, _ = _results()
    tag, cap, opts = ("_low_bit", cc.TINY, cm.LOW_BIT_CKPT) if low_bit else ("", 3 * cc.TINY, {})
    saved = (_checkpoint()[0]["low_bit"] if low_bit else _checkpoint()[0])["saved_sd"]
    blob = cc._load(tmp, f"mesh_2x2{tag}.pt")
    for how in ("sd", "dcp"):
        model = cc.new_model()
        model.load_state_dict(blob["model"])
        opt = DistributedFusedAdam(two_groups(model), bucket_cap_mb=cap, **opts)
        if how == "sd":
            opt.load_state_dict(blob["opt"])
        else:
            load_sharded(opt, os.path.join(tmp, f"dcp_2x2{tag}"))
        cc.assert_sd_equal(cm._sd(opt), saved)


def test_scaling_model_rows() -> None:
    """benchmarks/scaling_model.py (the table in docs/performance.md): inside one node flat and hybrid are the
    same; across nodes hybrid sends 1/8 of flat's network bytes asymptotically (the 1/8 shard
    all-reduced, 2S, against reduce-scatter + all-gather of everything, 2S), keeps 12 B/param / 8."""
    import importlib.util

    path = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "scaling_model.py")
    spec = importlib.util.spec_from_file_location("scaling_model", path)
    sm = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sm)
    size = 672e6 * 4
    one = sm.model(8, 8, size, 450.0, 50.0, 1.0, 0.0, 47.1)
    assert one["flat_comm_ms"] == one["hyb_comm_ms"] and one["flat_net_gb"] == one["hyb_net_gb"] == 0.0
    assert one["flat_nv_gb"] == pytest.approx(2 * 7 / 8 * size / 1e9)
    big = sm.model(1024, 8, size, 450.0, 50.0, 1.0, 0.0, 47.1)
    assert big["flat_net_gb"] == pytest.approx(2 * 1023 / 1024 * size / 1e9)
    assert big["hyb_net_gb"] == pytest.approx(2 * 127 / 128 * size / 8 / 1e9)
    assert big["hyb_opt_bpp"] == 1.5 and big["flat_opt_bpp"] == 12 / 1024
    assert big["hyb_step_ms"] < big["flat_step_ms"]
