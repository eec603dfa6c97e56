"""The CUDA step's launch configuration, for the dispatcher (``dispatch.py``): the tuning knobs
(SHARDAMP_CUDA_STEP's launch shape, SHARDAMP_CUDA_CHUNK's chunk size) read once, the chunk size
each state kind was tuned for, and the kernels' block-to-chunk tables, built on the host from the
segments and cached on the segment table (on CUDA from pinned memory, copied without a sync).
"""
from __future__ import annotations

from typing import Any, List, Optional

import torch
from torch import Tensor

from .. import config, state_formats
from ..layout import SegmentTable

# The tuning knobs as read at their first use: (SHARDAMP_CUDA_STEP's shape code, or 0;
# SHARDAMP_CUDA_CHUNK's chunk, or 0). Not read again at every step; ``refresh_knobs`` re-reads
# them (benchmarks/tune_step.py switches them between launches).
_knob_cache: Optional[tuple] = None


def refresh_knobs() -> tuple:
    """The tuning knobs SHARDAMP_CUDA_STEP and SHARDAMP_CUDA_CHUNK as the settings now hold them
    (after ``config.reload()`` re-read the environment: a bad value raises there, naming it)."""
    global _knob_cache
    shape = cuda_step_shape()
    _knob_cache = (CUDA_STEP_SHAPES.index(shape) + 1 if shape else 0, cuda_chunk(0))
    return _knob_cache


def knobs() -> tuple:
    """The tuning knobs as last read (``refresh_knobs``), read now if never read."""
    return _knob_cache if _knob_cache is not None else refresh_knobs()


def cuda_chunk(default: int) -> int:
    """Elements per chunk of the CUDA step: ``default`` (the kernels' ``CUDA_CHUNK``) unless the
    tuning knob ``SHARDAMP_CUDA_CHUNK`` sets another positive number (csrc/NOTES.md)."""
    return config.settings().cuda_chunk or default


# Elements per CUDA block (chunk) of the lighter steps, by state kind: each kind's step has its
# own launch shape (csrc/cuda/adam_step.cu, KindShape), and each chunk size is the fastest of the
# sizes timed for that shape (csrc/NOTES.md says why; docs/performance.md has the measurements):
# * fp32 master + bf16 moments, 1 step per thread at 4 blocks per SM: smaller chunks win as the
#   per-block start is amortised over fewer bytes: 2048 with fp32 grads; 4096 with 16-bit grads
#   (2048 was not timed there);
# * remainders, with bf16 moments (staged loads) or fp32 moments (3 blocks per SM): 4096;
# * one bf16 moment and one fp32 (2 steps per thread, not timed on its own): 8192, the size that
#   suited the 2-step shape of the other light kinds. fp32 master and moments keep ext.CUDA_CHUNK
#   (4096).
LIGHT_STATE_CUDA_CHUNK = 8192
BF16_MOMENTS_CUDA_CHUNK = 4096
BF16_MOMENTS_FP32_GRADS_CUDA_CHUNK = 2048
REMAINDERS_CUDA_CHUNK = 4096


def light_state(master: Tensor, exp_avg: Tensor, exp_avg_sq: Tensor, grad_dtype: Optional[torch.dtype] = None) -> int:
    """The CUDA chunk size the step of this state kind was tuned for (bf16 moments or int16
    remainders; ``grad_dtype``: the grads', fp32 if not given), or 0 for fp32 master and moments
    (the kernels' own ``CUDA_CHUNK``). Truthy for exactly the lighter kinds."""
    if exp_avg.dtype != exp_avg_sq.dtype:  # two formats: the mixed kind
        return LIGHT_STATE_CUDA_CHUNK
    if master.dtype == torch.int16:
        return REMAINDERS_CUDA_CHUNK
    if state_formats.of_dtype(exp_avg.dtype) is state_formats.FP32:
        return 0
    fp32_grads = grad_dtype in (None, torch.float32)
    return BF16_MOMENTS_FP32_GRADS_CUDA_CHUNK if fp32_grads else BF16_MOMENTS_CUDA_CHUNK


# The launch shapes SHARDAMP_CUDA_STEP may pick, in the order of their codes 1, 2, ... (adam_step's
# ``shape`` argument, csrc/cuda/adam_step.cu).
CUDA_STEP_SHAPES = config.CUDA_STEP_SHAPES


def cuda_step_shape() -> str:
    """The tuning knob ``SHARDAMP_CUDA_STEP`` ('' when unset): another launch shape for the
    light-state kinds the benchmark measures (csrc/NOTES.md, benchmarks/tune_step.py)."""
    return config.settings().cuda_step


def chunk_size(ext: Any, device: torch.device, light: int) -> int:
    """Elements per chunk of the step on ``device`` with the compiled module ``ext``: its CPU
    ``CHUNK``; on CUDA the SHARDAMP_CUDA_CHUNK knob, else the state kind's size ``light``
    (``light_state()``), else its ``CUDA_CHUNK``."""
    if device.type != "cuda":
        return ext.CHUNK
    return knobs()[1] or (int(light) if light else ext.CUDA_CHUNK)


def shard_chunks(ext: Any, segments: SegmentTable, device: torch.device, numel: int, steps: Tensor, hparams: Tensor,
                 light_state: int = 0) -> Tensor:
    """The kernels' block-to-chunk map of ``segments`` over a shard of ``numel`` elements on
    ``device``, cached on the table (built at construction by ``prepare``; rebuilt from the
    host-side segments if the chunk size changed): no device-to-host copy and no sync, even on
    the first step. ``light_state``: the kind's chunk size from ``light_state()`` (0: the fp32
    states' ``CUDA_CHUNK``)."""
    size = chunk_size(ext, device, light_state)
    key = f"native_chunks_{size}_{device}"
    chunks = segments.extra.get(key)
    if chunks is None:
        store(segments, key, chunk_table(segments, numel, steps.numel(), hparams.shape[0], size), device)
        chunks = segments.extra[key]
    return chunks


def _forget_knobs(settings: config.Settings) -> None:
    """New settings: the knobs are read again at their next use."""
    global _knob_cache
    _knob_cache = None


config.on_change(_forget_knobs)


def chunk_table(segments: SegmentTable, numel: int, n_params: int, n_groups: int, chunk: int) -> Tensor:
    """The host-side twin of csrc's ``build_chunks`` (same validation, same int64 ``[C, 2]``
    rows ``(first element, segment << 32 | length)``), from the host-side segments."""
    if not 0 < chunk < 2**32:
        raise ValueError(f"chunk={chunk}: expected 0 < chunk < 2**32")
    if len(segments.segments) >= 2**31:
        raise ValueError("too many segments")
    starts: List[Tensor] = []
    codes: List[Tensor] = []
    for i, s in enumerate(segments.segments):
        if not (s.start >= 0 and s.length >= 0 and s.start + s.length <= numel):
            raise ValueError(f"segment {i} [{s.start}, {s.start + s.length}) lies outside the shard of {numel} elements")
        if not 0 <= s.param_index < n_params:
            raise ValueError(f"segment {i}: param_index {s.param_index} out of range [0, {n_params})")
        if not 0 <= s.group < n_groups:
            raise ValueError(f"segment {i}: group {s.group} out of range [0, {n_groups})")
        offsets = torch.arange(0, s.length, chunk, dtype=torch.int64)
        starts.append(s.start + offsets)
        codes.append((i << 32) | torch.clamp(s.length - offsets, max=chunk))
    if not starts:
        return torch.empty(0, 2, dtype=torch.int64)
    return torch.stack([torch.cat(starts), torch.cat(codes)], dim=1)


def store(segments: SegmentTable, key: str, host: Tensor, device: torch.device) -> None:
    """Cache ``host`` on ``device`` under ``key``: from pinned memory, non-blocking (no host sync).
    The pinned copy is kept too: a copy captured in a CUDA graph reads it again at every replay."""
    if device.type == "cuda":
        pinned = segments.extra["pinned_" + key] = host.pin_memory()
        segments.extra[key] = pinned.to(device, non_blocking=True)
    else:
        segments.extra[key] = host
