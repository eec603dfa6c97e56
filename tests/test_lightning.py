"""ShardampStrategy (lightning.pytorch, pytorch_lightning, LightningCLI) and ShardampFabricStrategy
(lightning.fabric, lightning_fabric) on 2 gloo CPU ranks against unsharded torch.optim.AdamW
(tests/framework_ref.py). One spawned group runs every case (cases_lightning.py, which imports
cases_fabric.py); in-process checks of the registries, options and CLI are in
test_lightning_registry.py."""
from __future__ import annotations

import functools
import math
import tempfile

import pytest
import torch

pytest.importorskip("lightning")

import cases_lightning as cases  # noqa: E402
import framework_ref as ref  # noqa: E402
from dist_helper import case_values, run_cases, run_distributed  # noqa: E402

WORLD = 2
_TMP = tempfile.TemporaryDirectory()
TRAINER = "shardamp.integrations.lightning.ShardampStrategy"
STANDALONE_TRAINER = "shardamp.integrations.pytorch_lightning.ShardampStrategy"
FABRIC = "shardamp.integrations.lightning.ShardampFabricStrategy"
STANDALONE_FABRIC = "shardamp.integrations.lightning_fabric.ShardampFabricStrategy"


@functools.lru_cache(maxsize=None)
def _results(world: int):
    return run_distributed(run_cases, world, "cases_lightning", cases.CASES, {"tmp": _TMP.name})


def _values(world: int, case: str):
    """The case's values on every rank; skipped where it needs a package not installed."""
    if case in cases.NEEDS:
        pytest.importorskip(cases.NEEDS[case])
    return case_values(_results(world), case)


def _check_run(values, autocast_dtype=None, accumulate=1, lr_lambda=None, strategy=TRAINER):
    for v in values:
        assert v["strategy"] == strategy
        assert v["wrapped"] not in ("DistributedDataParallel", "_FabricModule"), v["wrapped"]
        assert v["world"] == WORLD
        if strategy in (TRAINER, STANDALONE_TRAINER):  # Trainer.fit's teardown dropped the grads, so
            # Lightning's module.cpu() (here a cast) moves the module; Fabric has no such teardown
            assert v["grads_none_after_fit"] and v["moves_after_fit"] == "ok", v["moves_after_fit"]
    # "norms": opt.grad_norm() after each step (Trainer) / fabric.clip_gradients' return (Fabric)
    return ref.check_run(values, cases.N_STEPS, "norms", autocast_dtype, accumulate, lr_lambda)


def _check_overflow_run(values, strategy):
    """fp16 with an overflow on rank 0 only at step 2: every rank skips it as torch does, the
    scale backs off once, the other steps clip and match torch's params."""
    params, norms, finite = ref.fp16_overflow_reference(values, cases.N_STEPS)
    for v in values:
        assert v["strategy"] == strategy
        if strategy in (TRAINER, STANDALONE_TRAINER):
            assert v["grads_none_after_fit"] and v["moves_after_fit"] == "ok", v["moves_after_fit"]
        assert v["scaler"] == "ShardedGradScaler"
        assert v["skipped"] == [not f for f in finite]
        assert v["scale"] == v["init_scale"] * 0.5  # one backoff (growth_interval 2000 not reached)
        assert [math.isfinite(n) for n in v["norms"]] == finite
        assert [n for n in v["norms"] if math.isfinite(n)] == pytest.approx(
            [n for n in norms if math.isfinite(n)], rel=1e-4)
        ref.assert_params_close(v["params"], params, bf16=True)
    for a, b in zip(values[0]["params"], values[1]["params"]):
        assert torch.equal(a, b)


def _assert_resumed_exactly(full, resumed) -> None:
    assert len(resumed["seen"]) == len(full["seen"]) // 2  # really resumed half-way
    for a, b in zip(full["params"], resumed["params"]):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


# ---------------------------------------------------------------------- lightning.pytorch Trainer
@pytest.mark.parametrize("world", [WORLD])
def test_registered_name_with_gradient_clip_val(world) -> None:
    _check_run(_values(world, "case_fp32_clip"))


@pytest.mark.parametrize("world", [WORLD])
def test_lr_scheduler_from_configure_optimizers(world) -> None:
    _check_run(_values(world, "case_lr_scheduler"), lr_lambda=cases.lr_lambda)


@pytest.mark.parametrize("world", [WORLD])
def test_bf16_mixed_with_gradient_clip_val(world) -> None:
    _check_run(_values(world, "case_bf16_clip"), autocast_dtype=torch.bfloat16)


@pytest.mark.parametrize("world", [WORLD])
def test_16_mixed_uses_sharded_grad_scaler_and_clips(world) -> None:
    values = _values(world, "case_fp16_sharded_scaler")
    for v in values:
        assert v["scaler"] == "ShardedGradScaler"
        assert v["skipped"] == [False] * cases.N_STEPS and v["scale"] == v["init_scale"]
        # unscaled before clipping (Lightning's plugin would not unscale an optimizer that unscales in step)
        assert not any("before unscaling" in w for w in v["warnings"]), v["warnings"]
    _check_run(values, autocast_dtype=torch.float16)


@pytest.mark.parametrize("world", [WORLD])
def test_accumulate_grad_batches_reduces_once_per_step(world) -> None:
    values = _check_run(_values(world, "case_accumulate_no_sync"), accumulate=3)
    for v in values:  # no_sync on the first two micro-batches: one reduce-scatter per bucket per step
        assert v["reduce_scatters"] == cases.N_STEPS * v["buckets"], v["reduce_scatters"]


@pytest.mark.parametrize("world", [WORLD])
@pytest.mark.parametrize("case", ["case_checkpoint_resume", "case_checkpoint_resume_sharded"])
def test_model_checkpoint_resume_equals_uninterrupted(world, case) -> None:
    for v in _values(world, case):
        assert "step=2.ckpt" in v["full"]["ckpts"]
        _assert_resumed_exactly(v["full"], v["resumed"])


@pytest.mark.parametrize("world", [WORLD])
def test_low_bit_moments_from_configure_optimizers_resume_exactly(world) -> None:
    for v in _values(world, "case_low_bit_checkpoint_resume_sharded"):
        assert v["full"]["moments"] == v["resumed"]["moments"] == ("4bit", "8bit")
        assert "step=2.ckpt" in v["full"]["ckpts"] and "step=2.ckpt.optim0" in v["full"]["ckpts"]
        _assert_resumed_exactly(v["full"], v["resumed"])


@pytest.mark.parametrize("world", [WORLD])
def test_sharded_checkpoint_names_its_shards_relative_and_removes_them_with_the_file(world) -> None:
    for v in _values(world, "case_checkpoint_resume_sharded"):
        assert v["entry"] == {"shardamp_dcp_dir": "step=2.ckpt.optim0"}  # a name beside the file, not a path
        assert v["full"]["ckpts"] == ["step=2.ckpt", "step=2.ckpt.optim0", "step=4.ckpt", "step=4.ckpt.optim0"]
        # save_top_k=1 removed step=2.ckpt: its shards went with it
        assert v["full"]["top1"] == ["step=4.ckpt", "step=4.ckpt.optim0"]


@pytest.mark.parametrize("world", [WORLD])
def test_sharded_checkpoint_at_a_url_moved_and_in_the_old_format(world) -> None:
    values = _values(world, "case_checkpoint_sharded_url_moved_and_old_format")
    _check_run([v["full"] for v in values])
    for v in values:
        assert v["full"]["strategy"] == TRAINER
        assert v["entry"] == {"shardamp_dcp_dir": "step=2.ckpt.optim0"}
        assert "shardamp-complete.json" in v["shard_files"] and ".metadata" in v["shard_files"]
        for how, resumed in v["resumed"].items():
            assert resumed["strategy"] == TRAINER, how
            _assert_resumed_exactly(v["full"], resumed)


@pytest.mark.parametrize("world", [WORLD])
def test_lightning_cli_fits_with_the_strategy_from_yaml(world) -> None:
    _check_run(_values(world, "case_cli_fit_from_yaml"))


# ---------------------------------------------------------------------- pytorch_lightning Trainer
@pytest.mark.parametrize("world", [WORLD])
def test_pytorch_lightning_16_mixed_skips_an_overflow_on_one_rank(world) -> None:
    _check_overflow_run(_values(world, "case_pl_standalone_fp16_overflow"), STANDALONE_TRAINER)


@pytest.mark.parametrize("world", [WORLD])
def test_pytorch_lightning_accumulates_and_resumes_sharded(world) -> None:
    values = _values(world, "case_pl_standalone_accumulate_sharded_resume")
    _check_run([v["full"] for v in values], accumulate=2, strategy=STANDALONE_TRAINER)
    for v in values:
        assert "step=2.ckpt.optim0" in v["full"]["ckpts"]
        _assert_resumed_exactly(v["full"], v["resumed"])


# ---------------------------------------------------------------------- Fabric
@pytest.mark.parametrize("world", [WORLD])
def test_fabric_clip_gradients_returns_the_true_norm_and_clips(world) -> None:
    values = _check_run(_values(world, "case_fabric_fp32_clip"), strategy=FABRIC)
    assert all(v["wrapped"] == "TinyNet" for v in values)  # no DDP around the model


@pytest.mark.parametrize("world", [WORLD])
def test_standalone_fabric_16_mixed_skips_an_overflow_on_one_rank(world) -> None:
    # clip_gradients ran with Fabric's default error_if_nonfinite=True: the step is skipped, nothing raised
    _check_overflow_run(_values(world, "case_fabric_standalone_fp16_overflow"), STANDALONE_FABRIC)


@pytest.mark.parametrize("world", [WORLD])
def test_fabric_no_backward_sync_reduces_once_per_step(world) -> None:
    values = _check_run(_values(world, "case_fabric_accumulate_no_sync"), accumulate=3, strategy=FABRIC)
    for v in values:
        assert v["reduce_scatters"] == cases.N_STEPS * v["buckets"], v["reduce_scatters"]


@pytest.mark.parametrize("world", [WORLD])
def test_fabric_save_load_full_and_sharded_at_a_url(world) -> None:
    values = _values(world, "case_fabric_save_load")
    _check_run([v["full"] for v in values], strategy=FABRIC)
    for v in values:
        _assert_resumed_exactly(v["full"], v["resumed"])
        _assert_resumed_exactly(v["full"], v["resumed_remote"])
    rank0 = values[0]
    assert rank0["file_step"] == 2
    assert rank0["file_optimizer_params"] == [0, 1, 2, 3]  # the whole state, gathered from both ranks' shards
    assert rank0["remote_entry"] == {"shardamp_dcp_dir": "state.ckpt.optimizer"}
    assert rank0["remote_files"] == ["state.ckpt", "state.ckpt.optimizer"]
    assert "shardamp-complete.json" in rank0["shard_files"] and ".metadata" in rank0["shard_files"]


@pytest.mark.parametrize("world", [WORLD])
def test_fabric_sharded_save_refuses_a_staging_dir_not_every_rank_sees(world) -> None:
    for v in _values(world, "case_fabric_staging_dir_not_shared_raises"):
        assert v["error"] is not None and "not visible on every rank" in v["error"] and "staging_dir=" in v["error"]
        assert v["written"] == [] and v["stage_left"] == []
