"""ShardampAccelerator on 2 gloo CPU ranks against unsharded torch.optim.AdamW (tests/framework_ref.py)."""
from __future__ import annotations

import functools
import math
import tempfile

import pytest
import torch

pytest.importorskip("accelerate")

import cases_accelerate as cases  # noqa: E402
import framework_ref as ref  # noqa: E402
from dist_helper import case_values, run_cases, run_distributed  # noqa: E402

WORLD = 2
_TMP = tempfile.TemporaryDirectory()


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
def test_other_optimizers_behave_as_accelerator(world) -> None:
    _check_run(case_values(_results(world), "case_plain_accelerator_is_unchanged_for_torch_optimizers"),
               wrapped="DistributedDataParallel")


@pytest.mark.parametrize("world", [WORLD])
def test_optimizer_prepared_without_its_model_raises(world) -> None:
    for message in case_values(_results(world), "case_model_not_prepared_raises"):
        assert message is not None and "was not prepared" in message


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
