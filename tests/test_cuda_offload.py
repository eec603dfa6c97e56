"""``offload="cpu"`` on GPUs: the offloaded run (pinned host state, the CPU kernels, the copies on
the side stream) against the run with the state on the GPU (the CUDA kernels), loops A, B and D
with clipping, ``skip_grad_norm_above``, ``no_sync``, an inf on one rank, fp32 / bf16 params, bf16
moments and ``offload_fraction=0.5`` (cases_offload.py), to the CPU-vs-CUDA kernel tolerance; the
same skips, norms, step stats and non-finite reports; grads copied during backward with no host
sync outside step; a CUDA graph capturing an offloaded step refused. NCCL at world 1 (and 2 where
two GPUs are visible). Skipped without a GPU; run with ``python -m pytest -q tests/test_cuda_offload.py``."""
from __future__ import annotations

import functools
import tempfile

import pytest
import torch

import cases_offload as co
from dist_helper import case_values, run_distributed
from parity import ATOL, RTOL
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
