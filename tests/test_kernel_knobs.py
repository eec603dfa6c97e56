"""The kernel dispatcher's environment knobs (SHARDAMP_CUDA_CHUNK, SHARDAMP_CUDA_STEP) and the
CUDA chunk size each state kind gets: validated values, never a silent fallback."""
from __future__ import annotations

import pytest
import torch

from shardamp.optim import kernels


def test_cuda_chunk_knob(monkeypatch):
    monkeypatch.delenv("SHARDAMP_CUDA_CHUNK", raising=False)
    assert kernels.cuda_chunk(4096) == 4096
    monkeypatch.setenv("SHARDAMP_CUDA_CHUNK", "8192")
    assert kernels.cuda_chunk(4096) == 8192
    for bad in ("0", "-5", "4k", "1.5"):
        monkeypatch.setenv("SHARDAMP_CUDA_CHUNK", bad)
        with pytest.raises(ValueError, match="SHARDAMP_CUDA_CHUNK"):
            kernels.cuda_chunk(4096)


def test_cuda_step_shape_knob(monkeypatch):
    monkeypatch.delenv("SHARDAMP_CUDA_STEP", raising=False)
    assert kernels.cuda_step_shape() == ""
    for ok in kernels.CUDA_STEP_SHAPES:
        monkeypatch.setenv("SHARDAMP_CUDA_STEP", ok)
        assert kernels.cuda_step_shape() == ok
    for bad in ("4x2", " 2x1", "c2x3"):
        monkeypatch.setenv("SHARDAMP_CUDA_STEP", bad)
        with pytest.raises(ValueError, match="SHARDAMP_CUDA_STEP"):
            kernels.cuda_step_shape()


def test_light_state_chunk_sizes():
    """Each state kind's CUDA chunk size (csrc/NOTES.md): 0 (CUDA_CHUNK) for fp32 states."""
    f, b, r = (torch.empty(1, dtype=d) for d in (torch.float32, torch.bfloat16, torch.int16))
    assert kernels.light_state(f, f, f) == 0
    assert kernels.light_state(f, b, b) == kernels.BF16_MOMENTS_CUDA_CHUNK == 16384
    assert kernels.light_state(r, f, f) == kernels.light_state(r, b, b) == kernels.REMAINDERS_CUDA_CHUNK == 4096
    assert kernels.light_state(f, f, b) == kernels.light_state(r, b, f) == kernels.LIGHT_STATE_CUDA_CHUNK == 8192
