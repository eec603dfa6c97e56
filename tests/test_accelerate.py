"""ShardampAccelerator on 2 gloo CPU ranks against unsharded torch.optim.AdamW (tests/framework_ref.py)."""
from __future__ import annotations

import functools
import math
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

pytest.importorskip("accelerate")

import cases_accelerate as cases  # noqa: E402
import framework_ref as ref  # noqa: E402
from dist_helper import case_values, run_cases, run_distributed  # noqa: E402

WORLD = 2
_TMP = tempfile.TemporaryDirectory()
ROOT = Path(__file__).resolve().parent.parent


@functools.lru_cache(maxsize=None)
def _results(world: int):
    return run_distributed(run_cases, world, "cases_accelerate", cases.CASES, {"tmp": _TMP.name})


def _check_run(values, autocast_dtype=None, accumulate=1, wrapped="TinyNet"):
    assert all(v["wrapped"] == wrapped for v in values)
    # "norms": what accelerator.clip_grad_norm_ returned
    return ref.check_run(values, cases.N_STEPS, "norms", autocast_dtype, accumulate)


@pytest.mark.parametrize("world", [WORLD])
def test_fp32_clip_grad_norm_clips_and_returns_the_true_norm(world) -> None:
    values = _check_run(case_values(_results(world), "case_fp32_clip"))
    assert all(v["world"] == WORLD for v in values)


@pytest.mark.parametrize("world", [WORLD])
def test_bf16_autocast_applies_without_ddp(world) -> None:
    _check_run(case_values(_results(world), "case_bf16_clip"), autocast_dtype=torch.bfloat16)


@pytest.mark.parametrize("world", [WORLD])
def test_fp16_uses_sharded_grad_scaler_and_skips_an_overflow_on_one_rank(world) -> None:
    values = case_values(_results(world), "case_fp16_sharded_grad_scaler")
    params, norms, finite = ref.fp16_overflow_reference(values, cases.N_STEPS)
    for v in values:
        assert v["scaler"] == "ShardedGradScaler"
        assert v["skipped"] == [not f for f in finite]  # optimizer_step_was_skipped on both ranks
        assert [math.isfinite(n) for n in v["norms"]] == finite
        assert [n for n in v["norms"] if math.isfinite(n)] == pytest.approx([n for n in norms if math.isfinite(n)],
                                                                            rel=1e-4)
        ref.assert_params_close(v["params"], params, bf16=True)
    for a, b in zip(values[0]["params"], values[1]["params"]):
        assert torch.equal(a, b)


@pytest.mark.parametrize("world", [WORLD])
def test_spike_skips_are_reported_to_accelerate(world) -> None:
    for v in case_values(_results(world), "case_spike_skips_are_skipped_steps"):
        assert v["skipped"] == [True] * cases.N_STEPS  # optimizer_step_was_skipped, every rank
        assert all(n > 1e-6 for n in v["norms"])
        assert v["lr"] == [ref.LR, ref.LR]  # the scheduler never advanced (1 / (1 + step) at step 0)
        for p, q in zip(v["params"], v["initial"]):
            torch.testing.assert_close(p, q, rtol=0, atol=0)


@pytest.mark.parametrize("world", [WORLD])
def test_accumulate_uses_no_sync(world) -> None:
    values = _check_run(case_values(_results(world), "case_accumulate_no_sync"), accumulate=3)
    for v in values:
        assert v["reduce_scatters"] == cases.N_STEPS * v["buckets"], v["reduce_scatters"]


@pytest.mark.parametrize("world", [WORLD])
def test_save_state_load_state_resume_exactly(world) -> None:
    for v in case_values(_results(world), "case_save_load_state"):
        assert "model.safetensors" in v["full"]["files"] and "optimizer.bin" in v["full"]["files"]
        assert len(v["resumed"]["seen"]) == len(v["full"]["seen"]) // 2  # really resumed half-way
        for a, b in zip(v["full"]["params"], v["resumed"]["params"]):
            torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("world", [WORLD])
def test_low_bit_moments_through_the_optimizer_kwargs_resume_exactly(world) -> None:
    for v in case_values(_results(world), "case_low_bit_accumulate_save_load_state"):
        assert v["full"]["moments"] == v["resumed"]["moments"] == ("8bit", "4bit")
        assert len(v["full"]["norms"]) == cases.N_STEPS and "optimizer.bin" in v["full"]["files"]
        assert any(not torch.equal(a, b) for a, b in zip(v["full"]["params"], v["full"]["initial"]))
        for a, b in zip(v["full"]["params"], v["resumed"]["params"]):
            torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("world", [WORLD])
def test_other_optimizers_behave_as_accelerator(world) -> None:
    _check_run(case_values(_results(world), "case_plain_accelerator_is_unchanged_for_torch_optimizers"),
               wrapped="DistributedDataParallel")


@pytest.mark.parametrize("world", [WORLD])
def test_optimizer_prepared_without_its_model_raises(world) -> None:
    for message in case_values(_results(world), "case_model_not_prepared_raises"):
        assert message is not None and "was not prepared" in message


@pytest.mark.parametrize("world", [WORLD])
def test_users_ddp_kwargs_handler_raises_naming_it_and_the_fix(world) -> None:
    for v in case_values(_results(world), "case_ddp_kwargs_handler_raises_for_distributed_fused_adam_only"):
        message = v["message"]
        assert message is not None and "kwargs_handlers=[DistributedDataParallelKwargs(" in message, message
        assert "bucket_cap_mb=5" in message and "find_unused_parameters=True" in message, message
        assert "Remove the DistributedDataParallelKwargs handler" in message and "DistributedFusedAdam(" in message
        # a torch optimizer's model: DDP built with the user's settings, as by Accelerator
        assert v["wrapped"] == "DistributedDataParallel"
        assert v["find_unused_parameters"] is True and v["bucket_bytes_cap"] == 5 * 1024 * 1024


@pytest.mark.parametrize("world", [WORLD])
def test_fsdp_deepspeed_megatron_xla_sharding_parallelism_and_no_refuse_the_optimizer(world) -> None:
    for v in case_values(_results(world), "case_sharding_setups_refuse_distributed_fused_adam"):
        for name in ("FSDP", "DEEPSPEED", "MEGATRON_LM", "XLA"):
            assert v[name] is not None and f"distributed_type={name}" in v[name], (name, v[name])
            assert "distributed_type: MULTI_GPU" in v[name] and "examples/accelerate_config.yaml" in v[name]
        assert v["tp"] is not None and "tp_size=2" in v["tp"] and "dp_replicate_size" in v["tp"], v["tp"]
        assert v["dp_shard"] is not None and "dp_shard_size=2" in v["dp_shard"], v["dp_shard"]
        assert v["NO"] is not None and "distributed_type=NO" in v["NO"] and "spans 2 ranks" in v["NO"], v["NO"]
        assert "cpu=True" in v["NO"] and "ACCELERATE_USE_CPU=true" in v["NO"], v["NO"]
        assert all(v[name + " prepared"] == 0 for name in ("FSDP", "DEEPSPEED", "tp", "NO"))  # raised before preparing


def test_accelerate_launch_with_the_example_config_trains_two_cpu_ranks(tmp_path) -> None:
    """``accelerate launch --config_file examples/accelerate_config.yaml``: the MULTI_GPU config
    starts two ranks through torchrun; the example builds Accelerator(cpu=True), so each rank runs
    MULTI_CPU over gloo (``--cpu`` / ``use_cpu: true`` would start one process: without mpirun
    accelerate's CPU launcher is the single-process one). The example checks its run against
    unsharded torch AdamW and prints PASS."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                        "NODE_RANK") and not k.startswith("ACCELERATE_")}
    examples = ROOT / "examples"
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
           str(examples / "accelerate_config.yaml"), str(examples / "accelerate_train.py"),
           "--steps", "4", "--warmup", "1", "--no-baseline", "--out", str(tmp_path)]
    # its own session: a launch that hangs is killed with torchrun's ranks, not only the launcher
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=600)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"accelerate launch did not finish in 600 s:\n{out[-5000:]}")
    assert proc.returncode == 0, out[-5000:]
    assert "world 2, clipped every step: yes" in out and "PASS" in out, out[-5000:]
    assert "save_state wrote: ['model.safetensors', 'optimizer.bin'" in out, out[-5000:]


def test_step_was_skipped_reads_the_device_verdict_lazily_once_per_step() -> None:
    from shardamp.integrations.accelerate import _ShardampAcceleratedOptimizer

    class Verdict:  # stands for the scaler's 0-d device tensor; counts the host reads
        reads = 0

        def __init__(self, value: bool) -> None:
            self.value = value

        def __bool__(self) -> bool:
            Verdict.reads += 1
            return self.value

    class Scaler:
        last_step_skipped = None

    opt = _ShardampAcceleratedOptimizer.__new__(_ShardampAcceleratedOptimizer)
    opt.scaler = Scaler()
    assert opt.step_was_skipped is False and Verdict.reads == 0  # before the first update
    opt.scaler.last_step_skipped = Verdict(True)
    assert Verdict.reads == 0  # nothing reads it until asked
    assert opt.step_was_skipped and opt.step_was_skipped and Verdict.reads == 1  # scheduler + Trainer
    opt.scaler.last_step_skipped = Verdict(False)  # the next update's verdict
    assert not opt.step_was_skipped and not opt.step_was_skipped and Verdict.reads == 2
    opt.scaler = None  # fp32 / bf16: no scaler, nothing to read
    assert opt.step_was_skipped is False
