"""What an optimizer moment is stored as: the one declaration of the state formats.

A :class:`StateFormat` says how this rank's shard of one moment (``exp_avg`` or ``exp_avg_sq``)
lives between steps: its storage dtype and bits per element, the extra tensors it needs (one
fp32 scale per block for the blockwise formats; none for the float formats), whether the
compiled kernels take it, how a user value (``exp_avg_dtype=`` / ``exp_avg_sq_dtype=``) selects
it, how a state dict carries it and how ``memory_stats`` counts its bytes. The buffers allocate
through it (``shards/buffers.py``), the dispatcher asks it which states the compiled kernels take
(``kernels/dispatch.py``), the state dicts and sharded checkpoints save, validate and load
through it (``checkpoint/``), the ranks compare its name at construction (``checks/agreement.py``)
and ``memory_stats`` counts it. A new format is one entry in :data:`FORMATS` plus its kernels.

The blockwise formats ``"8bit"`` and ``"4bit"`` store codes plus one fp32 scale per block
(docs/low-bit-states.md): the buffers hold them as ``kernels.quant.QuantizedShard``, the step
runs over them through its own kernels (``kernels/blockwise.py``: CPU and CUDA; the reference
math where none is built, CPU tensors only), and the checkpoints keep their codes and scales
(``checkpoint/quantized.py``).
Their ``zeros`` / ``state_dict_value`` / ``to_fp32`` / ``load`` are the float formats' alone.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Dict, Iterator, Optional, Tuple

import torch
from torch import Tensor

SCALE_DTYPE = torch.float32  # the blockwise formats' per-block absmax scale


@dataclass(frozen=True)
class StateFormat:
    """How one moment's shard is stored.

    ``name`` is what a state dict's ``"shardamp"`` extras record (``"bfloat16"``, as
    ``str(torch.bfloat16)`` without ``torch.``); ``storage_dtype`` is the dtype of the stored
    values (of the codes, for a blockwise format); ``bits`` per element of them;
    ``block_size`` > 0: one fp32 scale per block of that many elements (the default block of
    the format) is stored beside the codes; ``maps``: the code maps of a blockwise format,
    ``(exp_avg's, exp_avg_sq's)`` (``kernels/quant.py`` builds them); ``native``: the compiled kernels (csrc/) take a
    moment in this format, anything else runs the reference math; ``below_fp32``: stored with
    less precision than the fp32 moments ``torch.optim.AdamW`` keeps (what torch cannot carry
    over when it loads our state dict); ``available``: the constructor accepts it.
    """

    name: str
    storage_dtype: torch.dtype
    bits: int
    block_size: int = 0
    maps: Tuple[str, str] = ("", "")
    native: bool = False
    below_fp32: bool = False
    available: bool = True

    @property
    def blockwise(self) -> bool:
        """The format stores one scale per block beside its codes."""
        return self.block_size > 0

    @property
    def extra_tensors(self) -> Tuple[str, ...]:
        """The tensors stored beside the values, by name (``"scales"``: fp32, one per block)."""
        return ("scales",) if self.blockwise else ()

    def nbytes(self, numel: int) -> int:
        """Bytes this format holds for ``numel`` elements: the values (codes packed
        ``8 // bits`` to a byte below 8 bits) plus one fp32 scale per block, exactly."""
        values = (numel * self.bits + 7) // 8
        scales = math.ceil(numel / self.block_size) * SCALE_DTYPE.itemsize if self.blockwise else 0
        return values + scales

    def zeros(self, numel: int, device: torch.device) -> Tensor:
        """A zero state of ``numel`` elements, as the step reads it before the first update.

        Raises:
            NotImplementedError: the format is declared but not available (no kernels yet).
        """
        self._check_available()
        return torch.zeros(numel, dtype=self.storage_dtype, device=device)

    def state_dict_value(self, stored: Tensor) -> Tensor:
        """What a state dict holds for the stored values: the float formats are saved in their
        storage dtype, as they are (``torch.optim`` casts them to each param's dtype on load)."""
        self._check_available()
        return stored

    def to_fp32(self, stored: Tensor) -> Tensor:
        """The stored values as ``torch.optim.AdamW`` keeps moments (fp32; exact for bf16)."""
        self._check_available()
        return stored.float()

    def load(self, target: Tensor, values: Tensor) -> None:
        """Write ``values`` (any floating dtype, e.g. torch's fp32 moments) into the stored
        ``target``: converted to the storage dtype, rounded to nearest even."""
        self._check_available()
        target.copy_(values)

    def _check_available(self) -> None:
        if not self.available:
            raise NotImplementedError(f"the {self.name!r} moment format is declared but not available yet")
        if self.blockwise:  # codes and scales: kernels.quant.QuantizedShard and checkpoint/quantized.py
            raise TypeError(f"the {self.name!r} moment format is held as codes and block scales, not one tensor")


FP32 = StateFormat("float32", torch.float32, 32, native=True)
BF16 = StateFormat("bfloat16", torch.bfloat16, 16, native=True, below_fp32=True)
FP64 = StateFormat("float64", torch.float64, 64)  # dtype=torch.float64's moments: the reference path
# blockwise absmax formats: codes in uint8 (two 4-bit codes per byte); the maps and block sizes
# are the accuracy study's choice (docs/low-bit-states.md, benchmarks/quant_study.py)
Q8 = StateFormat("8bit", torch.uint8, 8, block_size=256, maps=("dynamic_sym", "dynamic_nz"), below_fp32=True)
Q4 = StateFormat("4bit", torch.uint8, 4, block_size=128, maps=("square", "square_nz"), below_fp32=True)

FORMATS: Dict[str, StateFormat] = {f.name: f for f in (FP32, BF16, FP64, Q8, Q4)}
# the user values the constructor's exp_avg_dtype / exp_avg_sq_dtype accept, besides None
_SELECTABLE: Tuple[Tuple[Any, StateFormat], ...] = ((torch.float32, FP32), (torch.bfloat16, BF16))
_BLOCKWISE: Tuple[Tuple[str, StateFormat], ...] = (("8bit", Q8), ("4bit", Q4))
ACCEPTED = 'None (the state dtype), torch.float32, torch.bfloat16, "8bit" or "4bit"'
BLOCK_MULTIPLE = 16  # a block size must be a multiple of this (layout.ALIGN: shards are whole blocks)


@dataclass(frozen=True)
class Moment:
    """One Adam moment: its state-dict key (torch.optim.AdamW's), the constructor argument that
    picks its format, and whether it may be negative (``exp_avg_sq`` never is: a negative one
    is a corrupted or mismatched state)."""

    key: str
    option: str
    signed: bool


EXP_AVG = Moment("exp_avg", "exp_avg_dtype", signed=True)
EXP_AVG_SQ = Moment("exp_avg_sq", "exp_avg_sq_dtype", signed=False)
MOMENTS: Tuple[Moment, ...] = (EXP_AVG, EXP_AVG_SQ)
MOMENT_KEYS: Tuple[str, ...] = tuple(m.key for m in MOMENTS)


@dataclass(frozen=True)
class MomentFormats:
    """The format of each moment (one value for the whole optimizer, every bucket alike)."""

    exp_avg: StateFormat
    exp_avg_sq: StateFormat

    def items(self) -> Iterator[Tuple[Moment, StateFormat]]:
        """``(moment, format)`` in ``MOMENTS``' order."""
        yield EXP_AVG, self.exp_avg
        yield EXP_AVG_SQ, self.exp_avg_sq

    def names(self) -> Dict[str, str]:
        """``{moment key: format name}`` (a blockwise one with its block size): what the ranks
        compare at construction."""
        return {m.key: f"{f.name} (block {f.block_size})" if f.blockwise else f.name for m, f in self.items()}

    @property
    def blockwise(self) -> bool:
        """Some moment stores codes and block scales."""
        return self.exp_avg.blockwise or self.exp_avg_sq.blockwise

    def attribute_values(self) -> Tuple[Any, Any]:
        """The optimizer's ``exp_avg_dtype`` / ``exp_avg_sq_dtype`` attributes: a float format's
        dtype, a blockwise one's name."""
        return tuple(f.name if f.blockwise else f.storage_dtype for _, f in self.items())  # type: ignore[return-value]

    def grid(self, align: int) -> int:
        """What every shard's length is a multiple of (``layout.pack``'s ``block``): ``align``,
        or with a blockwise moment the least common multiple of ``align`` and the formats'
        blocks (the larger block: 256 with an ``"8bit"`` moment, 128 with ``"4bit"`` ones), so
        shard boundaries fall on every moment's block grid."""
        return math.lcm(align, *(f.block_size for _, f in self.items() if f.blockwise))


def of_dtype(dtype: torch.dtype) -> Optional[StateFormat]:
    """The float format whose storage dtype is ``dtype`` (the stored tensor tells it), or None."""
    for fmt in (FP32, BF16, FP64):
        if fmt.storage_dtype == dtype:
            return fmt
    return None


def native_moment(dtype: torch.dtype) -> bool:
    """The compiled kernels take a moment stored as ``dtype``."""
    fmt = of_dtype(dtype)
    return fmt is not None and fmt.native


def resolve(option: str, value: Any, state_dtype: torch.dtype) -> StateFormat:
    """The format a user value of ``option`` (``"exp_avg_dtype"`` or ``"exp_avg_sq_dtype"``)
    selects; None: the state dtype's (``dtype=``, fp32 or fp64).

    Raises:
        ValueError: naming the argument, its value and the accepted values.
    """
    if value is None:
        fmt = of_dtype(state_dtype)
        if fmt is None:
            raise ValueError(f"dtype={state_dtype!r}: no moment format is stored as it")
        return fmt
    for user, fmt in _SELECTABLE:
        if isinstance(value, torch.dtype) and value == user:
            return fmt
    for name, fmt in _BLOCKWISE:
        if isinstance(value, str) and value == name:
            return fmt
    raise ValueError(f"{option}={value!r}: expected {ACCEPTED}")


def resolve_moments(state_dtype: torch.dtype, exp_avg_dtype: Any, exp_avg_sq_dtype: Any,
                    quant_block_size: Optional[int] = None) -> MomentFormats:
    """Both moments' formats from the constructor's arguments (``resolve`` each);
    ``quant_block_size``: the block of every blockwise moment (None: each format's default).

    Raises:
        ValueError: a value ``resolve`` refuses; ``quant_block_size`` not a positive multiple of
            ``BLOCK_MULTIPLE``, or given where neither moment is blockwise.
    """
    formats = MomentFormats(resolve(EXP_AVG.option, exp_avg_dtype, state_dtype),
                            resolve(EXP_AVG_SQ.option, exp_avg_sq_dtype, state_dtype))
    if quant_block_size is None:
        return formats
    if isinstance(quant_block_size, bool) or not isinstance(quant_block_size, int) or quant_block_size <= 0 \
            or quant_block_size % BLOCK_MULTIPLE:
        raise ValueError(f"quant_block_size={quant_block_size!r}: expected None (each format's default: "
                         f"{Q8.block_size} for \"8bit\", {Q4.block_size} for \"4bit\") or a positive multiple of "
                         f"{BLOCK_MULTIPLE}")
    if not formats.blockwise:
        raise ValueError(f"quant_block_size={quant_block_size}: neither moment is blockwise; pass exp_avg_dtype "
                         "or exp_avg_sq_dtype \"8bit\" or \"4bit\", or leave quant_block_size None")
    sized = [dataclasses.replace(f, block_size=quant_block_size) if f.blockwise else f for _, f in formats.items()]
    return MomentFormats(*sized)
