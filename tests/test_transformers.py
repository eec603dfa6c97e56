"""ShardampTrainer on 2 gloo CPU ranks against unsharded torch.optim.AdamW (tests/framework_ref.py);
ShardampTrainerMixin over TRL's SFTTrainer against the plain SFTTrainer (DDP + torch AdamW)."""
from __future__ import annotations

import functools
import math
import tempfile

import pytest
import torch

pytest.importorskip("transformers")

import cases_transformers as cases  # noqa: E402
import framework_ref as ref  # noqa: E402
from dist_helper import case_values, run_cases, run_distributed  # noqa: E402

WORLD = 2
_TMP = tempfile.TemporaryDirectory()


@functools.lru_cache(maxsize=None)
def _results(world: int):
    return run_distributed(run_cases, world, "cases_transformers", cases.CASES, {"tmp": _TMP.name})


def _check_run(values, autocast_dtype=None, accumulate=1, lr_lambda=None):
    for v in values:
        assert v["opt"] == "DistributedFusedAdam" and v["wrapped"] != "DistributedDataParallel"
        assert v["world"] == WORLD
        assert v["ddp_handler"] == "DistributedDataParallelKwargs"  # the Trainer's own handler was accepted
    # "grad_norms": the grad_norm the Trainer logged (max_grad_norm engaged on every step)
    return ref.check_run(values, cases.N_STEPS, "grad_norms", autocast_dtype, accumulate, lr_lambda)


@pytest.mark.parametrize("world", [WORLD])
def test_fp32_max_grad_norm_clips_and_logs_the_true_norm(world) -> None:
    _check_run(case_values(_results(world), "case_fp32_max_grad_norm"))


@pytest.mark.parametrize("world", [WORLD])
def test_linear_schedule(world) -> None:  # the Trainer's default schedule: linear decay to 0
    _check_run(case_values(_results(world), "case_linear_schedule"),
               lr_lambda=lambda s: (cases.N_STEPS - s) / cases.N_STEPS)


@pytest.mark.parametrize("world", [WORLD])
def test_bf16(world) -> None:
    _check_run(case_values(_results(world), "case_bf16_max_grad_norm"), autocast_dtype=torch.bfloat16)


@pytest.mark.parametrize("world", [WORLD])
def test_fp16_uses_sharded_grad_scaler_and_skips_an_overflow_on_one_rank(world) -> None:
    values = case_values(_results(world), "case_fp16_max_grad_norm")
    params, norms, finite = ref.fp16_overflow_reference(values, cases.N_STEPS)
    for v in values:
        assert v["scaler"] == "ShardedGradScaler" and v["opt"] == "DistributedFusedAdam"
        assert [math.isfinite(n) for n in v["grad_norms"]] == finite  # the logged norm is the true one
        assert [n for n in v["grad_norms"] if math.isfinite(n)] == pytest.approx(
            [n for n in norms if math.isfinite(n)], rel=1e-4)
        ref.assert_params_close(v["params"], params, bf16=True)
    for a, b in zip(values[0]["params"], values[1]["params"]):
        assert torch.equal(a, b)


@pytest.mark.parametrize("world", [WORLD])
def test_gradient_accumulation_uses_no_sync(world) -> None:
    values = _check_run(case_values(_results(world), "case_accumulate_no_sync"), accumulate=3)
    for v in values:
        assert v["reduce_scatters"] == cases.N_STEPS * v["buckets"], v["reduce_scatters"]


@pytest.mark.parametrize("world", [WORLD])
def test_save_steps_and_resume_from_checkpoint_continue_exactly(world) -> None:
    for v in case_values(_results(world), "case_save_steps_resume"):
        assert "checkpoint-2" in v["full"]["ckpts"]
        assert len(v["resumed"]["seen"]) == len(v["full"]["seen"]) // 2  # really resumed at step 2
        for a, b in zip(v["full"]["params"], v["resumed"]["params"]):
            torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("world", [WORLD])
def test_param_names_go_to_an_optimizer_that_accepts_them(world) -> None:
    decay, no_decay = ["fc1.weight", "fc2.weight"], ["fc1.bias", "fc2.bias"]  # Trainer's split: biases
    for v in case_values(_results(world), "case_param_names_when_the_optimizer_accepts_them"):
        assert v["named"]["type"] == "DistributedFusedAdam" and v["plain"]["type"] == "Unnamed"
        assert v["named"]["groups"] == [(decay, ref.WD, 2), (no_decay, 0.0, 2)]
        assert v["named"]["state_names"] == [decay, no_decay]  # kept in the state dict, as torch's
        assert v["plain"]["groups"] == [(None, ref.WD, 2), (None, 0.0, 2)]
        assert v["plain"]["buckets"] > v["named"]["buckets"]  # shardamp_optimizer_kwargs reached it


@pytest.mark.parametrize("world", [WORLD])
def test_low_bit_optim_names_select_the_moment_formats_or_raise_naming_the_kwargs(world) -> None:
    for v in case_values(_results(world), "case_low_bit_optim_names"):
        for optim in ("adamw_torch_8bit", "adamw_8bit", "adamw_bnb_8bit"):
            assert v[optim] == ("8bit", "8bit"), optim
        assert v["adamw_torch_4bit"] == ("4bit", "4bit")
        assert v["adamw_torch"] == (torch.float32, torch.float32)
        assert v["8bit_kwargs_win"] == ("8bit", torch.bfloat16)  # shardamp_optimizer_kwargs over optim's
        assert v["4bit_codes"] and all(c == (torch.uint8, torch.float32) for c in v["4bit_codes"].values())
        paged = v["paged_adamw_8bit"]
        assert "optim='paged_adamw_8bit'" in paged and "'adamw_torch_8bit'" in paged
        assert "shardamp_optimizer_kwargs={'exp_avg_dtype': '8bit', 'exp_avg_sq_dtype': '8bit'}" in paged
        assert "optim='lion_32bit'" in v["lion_32bit"] and "shardamp_optimizer_kwargs" not in v["lion_32bit"]
        assert "optim_args='block_size=64'" in v["with_optim_args"] and "'quant_block_size'" in v["with_optim_args"]


@pytest.mark.parametrize("world", [WORLD])
def test_trl_sft_trainer_with_the_mixin_matches_the_plain_sft_trainer(world) -> None:
    """fp32: bf16 autocast would make even torch's fused and foreach AdamW drift apart."""
    pytest.importorskip("trl")
    values = case_values(_results(world), "case_trl_sft_trainer_with_the_mixin")
    for v in values:
        plain, ours = v["plain"], v["shardamp"]
        assert plain["opt"] == "AdamW" and plain["wrapped"] == "DistributedDataParallel"
        assert ours["opt"] == "DistributedFusedAdam" and ours["wrapped"] != "DistributedDataParallel"
        assert plain["checkpointing"] and ours["checkpointing"]  # SFTConfig's default, through the mixin too
        assert ours["groups"] == plain["groups"] and {wd for wd, _ in ours["groups"]} == {0.0, 0.1}
        assert len(plain["grad_norms"]) == cases.SFT_STEPS
        assert min(plain["grad_norms"]) > cases.SFT_MAX_NORM, plain["grad_norms"]  # clipped every step
        assert ours["grad_norms"] == pytest.approx(plain["grad_norms"], rel=1e-4)
        assert ours["losses"] == pytest.approx(plain["losses"], rel=1e-6)
        moved = max((a - b).abs().max().item() for a, b in zip(plain["params"], plain["initial"]))
        assert moved > 100 * ref.ATOL, moved  # a run that did not train would fail the comparison
        ref.assert_params_close(ours["params"], plain["params"])
    for a, b in zip(values[0]["shardamp"]["params"], values[1]["shardamp"]["params"]):
        assert torch.equal(a, b)


def test_mixin_after_the_trainer_or_another_optimizer_class_raises_naming_the_fix() -> None:
    from transformers import Trainer

    from shardamp.integrations.transformers import ShardampTrainerMixin

    with pytest.raises(TypeError, match=r"class Late\(ShardampTrainerMixin, <your Trainer subclass>\)"):
        class Late(Trainer, ShardampTrainerMixin):
            pass

    with pytest.raises(TypeError, match=r"shardamp_optimizer_class=.*AdamW.*optimizers=\(opt, scheduler\)"):
        class TorchAdamW(ShardampTrainerMixin, Trainer):
            shardamp_optimizer_class = torch.optim.AdamW

    class Early(ShardampTrainerMixin, Trainer):  # the documented order
        pass

    class Composable(ShardampTrainerMixin):  # no Trainer yet: nothing to check
        pass

    assert Early.create_optimizer is ShardampTrainerMixin.create_optimizer
    assert Composable.__mro__[1] is ShardampTrainerMixin
