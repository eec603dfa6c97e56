"""``offload="cpu"`` on GPUs: the offloaded run (pinned host state, the CPU kernels, the copies on
the side stream) against the run with the state on the GPU (the CUDA kernels), loops A to G
with clipping, ``skip_grad_norm_above``, ``no_sync``, an inf on one rank, fp32 / bf16 params, bf16
moments and ``offload_fraction=0.5`` (cases_offload.py), to the CPU-vs-CUDA kernel tolerance; the
same skips, norms, step stats and non-finite reports; grads copied during backward with no host
sync outside step; a CUDA graph capturing an offloaded step refused. NCCL at world 1 (and 2 where
two GPUs are visible). Blockwise moments on CUDA params with every bucket offloaded run on the CPU
kernels without the CUDA blockwise kernel, bitwise the run on CPU params, and their state dict
round-trips; half offloaded they need that kernel. State dicts and sharded checkpoints saved
offloaded load with the state on the GPU and back, bitwise. Skipped without a GPU; run with
``python -m pytest -q tests/test_cuda_offload.py``."""
from __future__ import annotations

import functools
import tempfile

import pytest
import torch

import cases_low_bit as cl
import cases_offload as co
from dist_helper import case_values, run_distributed
from parity import ATOL, RTOL
from shardamp.optim import DistributedFusedAdam, kernels
from shardamp.optim.kernels import blockwise
from shardamp.optim.shards.host_state import CAPTURE_ERROR

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

WORLDS = [1, 2] if torch.cuda.is_available() and torch.cuda.device_count() >= 2 else [1]


@functools.lru_cache(maxsize=None)
def _results(world: int):
    tmp = tempfile.mkdtemp(prefix="shardamp-cuda-offload-")
    return run_distributed(co.run, world, tmp, ["case_loops", "case_pipelined", "case_capture_refused"], "cuda",
                           backend="nccl")


def _close(a: torch.Tensor, b: torch.Tensor, where) -> None:
    # bf16 params: the CPU and CUDA kernels may round the same master to neighbouring bf16 values
    rtol, atol = (2.0 ** -7, 1e-5) if a.dtype == torch.bfloat16 else (RTOL, ATOL)
    torch.testing.assert_close(a.float(), b.float(), rtol=rtol, atol=atol, equal_nan=True, msg=str(where))


@pytest.mark.parametrize("world", WORLDS)
def test_offloaded_loops_match_the_state_on_the_gpu(world):
    for rank, value in enumerate(case_values(_results(world), "case_loops")):
        for (config, loop), runs in value.items():
            a, b = runs[None], runs["cpu"]
            for step, (sa, sb) in enumerate(zip(a["steps"], b["steps"])):
                for x, y in zip(sa["params"], sb["params"]):
                    _close(x, y, (world, rank, config, loop, step))
                for key in sa:
                    if key != "params":  # the norms and scales come from the same device statistics
                        v, u = sa[key], sb[key]
                        if isinstance(v, torch.Tensor):
                            _close(v, u, (world, rank, config, loop, step, key))
                        else:
                            assert v == u, (world, rank, config, loop, step, key)
            assert a["step_stats"]["skipped_nonfinite"] == b["step_stats"]["skipped_nonfinite"] == 1
            assert a["step_stats"]["skipped_spike"] == b["step_stats"]["skipped_spike"]
            assert a["step_stats"]["steps"] == b["step_stats"]["steps"]
            assert a["last_nonfinite"] == b["last_nonfinite"]
            for i, entry in a["sd"]["state"].items():
                for k, t in entry.items():
                    _close(t, b["sd"]["state"][i][k], (world, rank, config, loop, i, k))
            assert b["host_buckets"] and b["host_separate"] and b["memory"]["host_total"] > 0
            assert b["memory"]["moments"] + b["memory"]["host_moments"] == a["memory"]["moments"]


@pytest.mark.parametrize("world", WORLDS)
def test_offloaded_copies_pinned_during_backward_without_host_syncs(world):
    for value in case_values(_results(world), "case_pipelined"):
        assert value["copied_in_backward"] == [True, True, True]
        assert value["pinned"] and all(value["pinned"])


@pytest.mark.parametrize("world", WORLDS)
def test_capturing_an_offloaded_step_raises(world):
    for error in case_values(_results(world), "case_capture_refused"):
        assert error == CAPTURE_ERROR


LOW_BIT = dict(exp_avg_dtype="8bit", exp_avg_sq_dtype="4bit")


def _linear_loss_run(device: str, steps: int = 4, dtype: torch.dtype = torch.float32, formats=LOW_BIT, **options):
    """Two groups, several buckets; a loss linear in the params, so each grad is its coefficient
    (made on the CPU) exactly, on any device; an inf step at step 2. The params per step, the
    optimizer and the model."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(40, 30), torch.nn.Linear(30, 20)).to(device, dtype)
    ps = list(model.parameters())
    opt = DistributedFusedAdam([{"params": ps[:2], "lr": 0.01, "weight_decay": 0.1}, {"params": ps[2:], "lr": 0.02}],
                               bucket_cap_mb=0.002, **formats, **options)
    gen = torch.Generator().manual_seed(1)
    trace = []
    for step in range(steps):
        opt.zero_grad()
        coefs = [torch.randn(p.shape, generator=gen) for p in ps]
        scale = float("inf") if step == 2 else 1.0
        (sum((p.float() * c.to(device)).sum() for p, c in zip(ps, coefs)) * scale).backward()
        opt.step()
        trace.append([p.detach().cpu().clone() for p in ps])
    return trace, opt, model


def test_blockwise_moments_all_offloaded_need_no_cuda_blockwise_kernel(monkeypatch):
    """offload_fraction=1.0: every bucket's "8bit" / "4bit" moments live on the host and the CPU
    kernel steps them, so CUDA params construct and train with the CUDA module's blockwise step
    hidden (a bucket stepped on the GPU would raise), bitwise the same run on CPU params; its
    state dict (scales gathered from the host) equals that run's and loads back (codes written on
    the host). offload_fraction=0.5 keeps buckets on the GPU: refused at construction, naming
    the fix."""
    cuda_ext = kernels.native_module(torch.device("cuda"))
    real = blockwise.has_kernel
    monkeypatch.setattr(blockwise, "has_kernel", lambda ext: real(ext) and ext is not cuda_ext)
    ref_trace, ref_opt, _ = _linear_loss_run("cpu")
    trace, opt, _ = _linear_loss_run("cuda", offload="cpu")
    assert len(opt._buckets) > 1 and sorted(opt._host.shards) == list(range(len(opt._buckets)))
    assert all(hs.launch.blockwise_natives is not None for hs in opt._host.shards.values())  # the native CPU step
    for step, (a, b) in enumerate(zip(ref_trace, trace)):
        assert all(torch.equal(x, y) for x, y in zip(a, b)), step
    assert all(torch.equal(x, y) for x, y in zip(trace[2], trace[1]))  # the inf step skipped
    sd = cl.quiet_sd(opt)
    assert cl.sd_equal(cl.quiet_sd(ref_opt), sd) == ""
    _, loaded, _ = _linear_loss_run("cuda", steps=0, offload="cpu")
    loaded.load_state_dict(sd)
    assert cl.sd_equal(sd, cl.quiet_sd(loaded)) == ""
    with pytest.raises(NotImplementedError, match=r"offload='cpu' with offload_fraction=1.0"):
        _linear_loss_run("cuda", steps=0, offload="cpu", offload_fraction=0.5)


@pytest.mark.parametrize("formats", [{}, LOW_BIT], ids=["fp32_moments", "q8_q4"])
def test_checkpoints_saved_offloaded_on_the_gpu_load_with_the_state_on_the_gpu_and_back(tmp_path, formats):
    """bf16 params on the GPU, offloaded: its state dict and its sharded checkpoint load into the
    same optimizer with the state on the GPU and into an offloaded one, bitwise (the fp32 master,
    the moments in their format, the steps); trained on, the two stay within the CPU-vs-CUDA
    kernel tolerance."""
    from shardamp.optim.checkpoint import load_sharded, save_sharded

    _, opt, model = _linear_loss_run("cuda", dtype=torch.bfloat16, formats=formats, offload="cpu")
    sd = cl.quiet_sd(opt)
    save_sharded(opt, tmp_path / "offloaded")
    for how in ("sd", "dcp"):
        finals = {}
        for off in (None, "cpu"):
            _, other, other_model = _linear_loss_run("cuda", steps=0, dtype=torch.bfloat16, formats=formats, offload=off)
            other_model.load_state_dict(model.state_dict())
            if how == "sd":
                other.load_state_dict(sd)
            else:
                load_sharded(other, tmp_path / "offloaded")
            assert cl.sd_equal(sd, cl.quiet_sd(other)) == "", (how, off)
            other.zero_grad()
            sum(p.float().sum() for p in other_model.parameters()).backward()
            other.step()
            finals[off] = [p.detach().cpu() for p in other_model.parameters()]
        for a, b in zip(finals[None], finals["cpu"]):
            _close(a, b, how)
