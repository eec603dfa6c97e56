"""The step of a shard with blockwise moments (``"8bit"`` / ``"4bit"``: ``quant.QuantizedShard``),
the one seam between ``adam_launch.AdamLaunch`` and the compiled ``adam_step_blockwise``
(csrc/binding_blockwise.cpp; contract: ``reference.py``'s ``adam_step`` over quantized moments).

Where the compiled module has the kernel and takes the state's dtypes, one native call runs the
step: CPU tensors through ``cpu/adam_blockwise_cpu.cpp`` (bitwise the reference), CUDA tensors
through ``cuda/adam_step_blockwise.cu`` (csrc/NOTES.md: its agreement with the reference).
Otherwise CPU tensors run the reference math, and CUDA tensors raise (:func:`require_kernel`)
unless ``SHARDAMP_KERNELS=reference`` asks for the reference there too.

Each launch keeps its moments' native descriptions (``QuantMoment``: codes, scales, code map and
midpoints; or a float moment's tensor) from its first native step; on CUDA the unit table (each
unit's range of segments, built on the host from the host-side segments and copied once) is cached
on the segment table: no step reads a device value on the host.
"""
from __future__ import annotations

import math
from typing import Any, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor

from .. import config
from ..layout import SegmentTable
from . import reference
from .launch_config import store
from .quant import QuantizedShard

_NATIVE_GRADS = (torch.float32, torch.bfloat16, torch.float16)
# QuantMoment kinds (csrc/quant.h MomentKind)
_KINDS = {torch.float32: 0, torch.bfloat16: 1}
_CODES = {8: 2, 4: 3}


def takes(exp_avg: object, exp_avg_sq: object) -> bool:
    """Some moment is blockwise: the step goes through :func:`launch`."""
    return isinstance(exp_avg, QuantizedShard) or isinstance(exp_avg_sq, QuantizedShard)


def has_kernel(ext: Optional[Any]) -> bool:
    """The compiled module ``ext`` has the blockwise step."""
    return ext is not None and hasattr(ext, "adam_step_blockwise")


def require_kernel(ext: Optional[Any], device: torch.device, what: str) -> None:
    """Blockwise moments on a CUDA ``device`` need the compiled kernel (the reference math runs
    there only when ``SHARDAMP_KERNELS=reference`` asks for it).

    Raises:
        NotImplementedError: CUDA, and ``ext`` lacks the kernel; naming ``what`` and the fixes.
    """
    if device.type != "cuda" or has_kernel(ext) or config.settings().kernels == "reference":
        return
    why = "no CUDA kernels were built or loaded" if ext is None else "the loaded CUDA kernels predate it"
    raise NotImplementedError(
        f"{what}: the blockwise moment formats on CUDA need the compiled adam_step_blockwise kernel, and {why} "
        "(python -m shardamp.report --build says why); pass exp_avg_dtype / exp_avg_sq_dtype torch.float32 or "
        "torch.bfloat16, keep every bucket's state in host memory (offload='cpu' with offload_fraction=1.0: the CPU "
        "kernels step it), or set SHARDAMP_KERNELS=reference to run the reference math on the GPU (slow)")


def _dtypes_native(launch: Any, grad: Tensor) -> bool:
    """The compiled kernel takes these dtypes: fp32/bf16/fp16 grads and params, an fp32 master
    or int16 remainders under bf16 params, fp32 or bf16 float moments."""
    master, out = launch.master, launch.model_out
    if not (master.dtype == torch.float32 or (master.dtype == torch.int16 and out is not None
                                              and out.dtype == torch.bfloat16)):
        return False
    moments = all(isinstance(s, QuantizedShard) or s.dtype in _KINDS for s in (launch.exp_avg, launch.exp_avg_sq))
    return moments and grad.dtype in _NATIVE_GRADS and (out is None or out.dtype in _NATIVE_GRADS)


def native_moment(ext: Any, state: Union[Tensor, QuantizedShard]) -> Any:
    """``state`` as the kernel's ``QuantMoment``."""
    if isinstance(state, QuantizedShard):
        return ext.QuantMoment(values=state.codes, kind=_CODES[state.fmt.bits], scales=state.scales,
                               map=state.qmap(), mids=state.midpoints(), search=state.search_table(),
                               block=state.block_size)
    return ext.QuantMoment(values=state, kind=_KINDS[state.dtype])


def unit(exp_avg: object, exp_avg_sq: object) -> int:
    """Elements per unit of the kernels' work: the least common multiple of the blockwise moments'
    blocks (a unit holds whole blocks of each)."""
    return math.lcm(*(s.block_size for s in (exp_avg, exp_avg_sq) if isinstance(s, QuantizedShard)))


def unit_table(segments: SegmentTable, numel: int, unit_size: int) -> Tensor:
    """int32 ``[ceil(numel / unit_size), 2]`` on the host: for each unit of ``unit_size`` elements,
    the range ``[first, end)`` of the rows of ``segments`` that overlap it (rows sorted by start).

    Raises:
        ValueError: the rows are not sorted by start and disjoint, or lie outside the shard.
    """
    rows = segments.segments
    starts = torch.tensor([s.start for s in rows], dtype=torch.int64)
    ends = torch.tensor([s.start + s.length for s in rows], dtype=torch.int64)
    if len(rows) and (bool((starts[1:] < ends[:-1]).any()) or int(starts.min()) < 0 or int(ends.max()) > numel):
        raise ValueError("adam_step_blockwise: the segments must be sorted by start, disjoint and inside the shard "
                         f"of {numel} elements")
    lo = torch.arange(0, numel, unit_size, dtype=torch.int64)
    hi = torch.clamp(lo + unit_size, max=numel)
    first = torch.searchsorted(ends, lo, right=True)  # the first row ending after the unit's start
    end = torch.searchsorted(starts, hi, right=False)  # the first row starting at or after its end
    return torch.stack([first, torch.maximum(first, end)], dim=1).to(torch.int32).contiguous()


def _units(segments: SegmentTable, numel: int, unit_size: int, device: torch.device) -> Tensor:
    key = f"blockwise_units_{unit_size}_{device}"
    if key not in segments.extra:
        store(segments, key, unit_table(segments, numel, unit_size), device)
    return segments.extra[key]


def _natives(ext: Any, launch: Any) -> Tuple[Any, Any]:
    """The launch's moments as ``QuantMoment`` (made once; again if its state tensors changed)."""
    key = (id(ext), id(launch.exp_avg), id(launch.exp_avg_sq))
    cached = launch.blockwise_natives
    if cached is None or cached[0] != key:
        cached = (key, native_moment(ext, launch.exp_avg), native_moment(ext, launch.exp_avg_sq))
        launch.blockwise_natives = cached
    return cached[1], cached[2]


def launch(ext: Optional[Any], launch: Any, host_rows: Tensor) -> None:
    """One shard's step with blockwise moments (``launch``: a ``adam_launch.AdamLaunch``), natively
    where ``ext`` has the kernel and takes the dtypes, else the reference math (``host_rows``:
    the segments on the host). No host sync.

    Raises:
        NotImplementedError: CUDA tensors and no kernel (:func:`require_kernel`).
    """
    grad = launch.grad
    if has_kernel(ext) and _dtypes_native(launch, grad):
        m, v = _natives(ext, launch)
        units = records = None
        if grad.device.type == "cuda":
            units = _units(launch.segments, grad.numel(), unit(launch.exp_avg, launch.exp_avg_sq), grad.device)
            records = launch.records
        ext.adam_step_blockwise(grad, launch.master, m, v, launch.model_out, launch.segments.table, launch.hparams,
                                launch.steps, launch.touched, launch.grad_coef, launch.found_inf, launch.adam_w_mode,
                                launch.bias_correction, units, records, launch.record_offset)
        return
    require_kernel(ext if has_kernel(ext) else None, grad.device, "the step over blockwise moments")
    reference.adam_step(grad, launch.master, launch.exp_avg, launch.exp_avg_sq, launch.model_out, host_rows,
                        launch.hparams, launch.steps, launch.touched, launch.grad_coef, launch.found_inf,
                        launch.adam_w_mode, launch.bias_correction)


def check_formats(formats: Any, state_devices: Sequence[torch.device], ext: Optional[Any]) -> None:
    """At construction: the moment formats ``formats`` (``state_formats.MomentFormats``) can run
    where each bucket's state lives, ``state_devices`` (one per bucket: the params' device, or
    the host for a bucket offloaded by ``offload="cpu"``, ``HostState.state_devices``), with
    ``ext``, the compiled module of the params' device (``dispatch.native_module``). A bucket
    whose state is on the host is stepped by the CPU kernels, so blockwise moments need the CUDA
    kernel (and its tile) only where some bucket's state stays on a GPU.

    Raises:
        NotImplementedError: blockwise moments with some bucket's state on CUDA and no kernel
            (:func:`require_kernel`).
        ValueError: the same, blocks whose least common multiple exceeds the kernel's tile.
    """
    cuda = next((d for d in state_devices if d.type == "cuda"), None)
    if not formats.blockwise or cuda is None:
        return
    exp_avg, exp_avg_sq = formats.attribute_values()
    require_kernel(ext, cuda, f"exp_avg_dtype={exp_avg!r}, exp_avg_sq_dtype={exp_avg_sq!r}")
    blocks = [f.block_size for _, f in formats.items() if f.blockwise]
    tile = getattr(ext, "BLOCKWISE_CUDA_TILE", 0) if has_kernel(ext) else 0
    if tile and math.lcm(*blocks) > tile:
        raise ValueError(f"quant_block_size={blocks[0]}: the CUDA step over blockwise moments takes blocks of at most "
                         f"{tile} elements; pass a smaller quant_block_size (or None: each format's default)")
