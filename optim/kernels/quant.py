"""Blockwise quantization of the optimizer moments: the math of the ``"8bit"`` and ``"4bit"``
moment formats (``state_formats.py``) as plain functions over flat tensors, as ``reference.py``
is the math of the step: the specification the compiled kernels (csrc/quant.h, the blockwise step
of ``blockwise.py``) implement (docs/low-bit-states.md: the accuracy study that chose the maps, and
the design of the step). :class:`QuantizedShard` is one moment's shard as the buffers hold it
(codes and scales) and the steps read and write it.

A moment's shard is cut into blocks of ``block_size`` elements on a fixed grid of the BUCKET's
flat element space: block ``k`` covers bucket elements ``[k * block_size, (k + 1) * block_size)``,
whatever the world size. A shard must therefore start on a block boundary (``offset``, the
bucket-relative index of its first element, is a multiple of ``block_size``), and then its
codes and scales are bitwise those of the same elements quantized as one piece: the state is
the same at every world size. Only the bucket's last block may be partial.

Each block stores one fp32 scale, its absmax, and one code per element: the index of the
nearest value of a code map (sorted fp32 values in ``[-1, 1]``, signed, for ``exp_avg``; in
``[0, 1]``, unsigned, for ``exp_avg_sq``) to ``x / scale`` (ties to the lower code). A code
dequantizes to ``map[code] * scale``. 4-bit codes are packed two to a byte, the even element in
the low nibble. Inputs are finite (the step skips on a non-finite grad, so the moments stay
finite); ``exp_avg_sq`` is >= 0. No finite input gives a non-finite output: ``|x / scale| <= 1``
and ``|map| <= 1``. Denormal inputs and scales are taken as they are (the kernels must not
flush them to zero).

The zero-code rule: the formats' ``exp_avg_sq`` maps have no zero value (required at 4 bits,
chosen at 8), so no code of a block whose scale is > 0 dequantizes to 0 (a second moment rounded
to 0 would divide an update by ``eps`` alone); an all-zero block has scale 0 and dequantizes to
the zeros it holds. Only a scale below fp32's smallest normal (~1e-38) could underflow
``map[0] * scale`` to 0, and there ``sqrt(v)`` < 1e-19 is far below any ``eps``.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Callable, Dict, Optional, Tuple

import torch
from torch import Tensor

from ..state_formats import StateFormat

# The maps the accuracy study compares (benchmarks/quant_study.py, docs/low-bit-states.md); the
# formats' own are named in state_formats.py (``StateFormat.maps``).
MAP_KINDS = ("linear", "linear_nz", "dynamic", "dynamic_sym", "dynamic_nz", "square", "square_nz")


def _linear(bits: int, signed: bool, zero: bool) -> list:
    n = 2 ** bits
    if signed:
        # 2**bits - 1 values symmetric about 0 (0 included), the last code a copy of 1.0: a
        # symmetric map keeps E[q(-x)] = -E[q(x)]
        half = n // 2 - 1
        vals = [k / half for k in range(-half, half + 1)]
        return vals + [1.0]
    if zero:
        return [k / (n - 1) for k in range(n)]
    return [(k + 1) / n for k in range(n)]  # 1/n .. 1: no zero


def _dynamic(bits: int, signed: bool, zero: bool) -> list:
    """Dynamic-exponent values (Dettmers 2016, 8-bit approximations): a decade exponent
    ``-e`` (``e`` in ``0 .. E-1``, ``E = bits - 1`` for 8 bits, 3 for 4) whose unary encoding
    leaves the remaining bits to a linear fraction in (0.1, 1]: level ``i`` (10**(i - E + 1))
    holds 2**i fraction values (2**(i + 1) unsigned, which has no sign bit), the midpoints of
    that many equal bins of [0.1, 1]; then 0 and 1. Without ``zero``, the unsigned map's 0 is
    replaced by half its smallest value."""
    exp_levels = 7 if bits == 8 else 3
    free = bits - 1  # bits besides the sign (the unsigned map uses its sign bit as one more fraction bit)
    vals = []
    for i in range(exp_levels):
        count = 2 ** (i + free - exp_levels + (0 if signed else 1))
        width = 0.9 / count
        mids = [0.1 + width * (j + 0.5) for j in range(count)]
        decade = 10.0 ** (i - exp_levels + 1)
        vals += [decade * f for f in mids]
        if signed:
            vals += [-decade * f for f in mids]
    extra = 2 ** (free - exp_levels) - 1  # codes left when the exponent bits do not use all of them
    if extra > 0:
        width = 0.9 / extra
        mids = [0.1 + width * (j + 0.5) for j in range(extra)]
        vals += [f for f in mids] + ([-f for f in mids] if signed else [])
    vals += [1.0]
    if signed or zero:
        vals += [0.0]
    else:
        vals += [min(vals) / 2]
    while len(vals) < 2 ** bits:  # the unsigned 4-bit map has one code to spare: a copy of 1.0
        vals.append(1.0)
    return vals


def _dynamic_sym(bits: int, signed: bool, zero: bool) -> list:
    """The signed dynamic map made symmetric: ``_dynamic``'s signed map reaches +1 but not -1 (a
    block whose absmax element is negative loses up to 11% on it at 4 bits); here both signs
    take the positive magnitudes, 1 included, less the smallest; the spare code is a copy of 1."""
    if not signed:
        return _dynamic(bits, signed, zero)
    mags = sorted(v for v in _dynamic(bits, True, True) if v > 0)[1:]
    return [0.0] + mags + [-v for v in mags] + [1.0]


def _square(bits: int, signed: bool, zero: bool) -> list:
    """Squares of a linear map: the linear map of ``sqrt(|x|)``, finer near 0 (the second
    moment is the square of a grad scale, so this is a linear map of that scale)."""
    if signed:
        return [(1 if v >= 0 else -1) * v * v for v in _linear(bits, True, True)]
    return [v * v for v in _linear(bits, False, zero)]


@functools.lru_cache(maxsize=None)
def _map_values(kind: str, bits: int, signed: bool) -> Tuple[float, ...]:
    if kind not in MAP_KINDS:
        raise ValueError(f"map kind {kind!r}: expected one of {MAP_KINDS}")
    if bits not in (4, 8):
        raise ValueError(f"bits={bits!r}: expected 4 or 8")
    base, zero = kind[:-3] if kind.endswith("_nz") else kind, not kind.endswith("_nz")
    if signed and not zero:
        raise ValueError(f"map kind {kind!r}: a signed map keeps its zero (exp_avg is 0 where grads are)")
    vals = {"linear": _linear, "dynamic": _dynamic, "dynamic_sym": _dynamic_sym, "square": _square}[base](
        bits, signed, zero)
    if len(vals) != 2 ** bits:
        raise AssertionError(f"{kind} map with {bits} bits has {len(vals)} values")
    return tuple(sorted(vals))


def code_map(kind: str, bits: int, signed: bool) -> Tensor:
    """The ``2**bits`` sorted fp32 values of a code map (``kind`` in ``MAP_KINDS``; ``_nz``: no
    zero value, unsigned only), ``max |value| == 1``.

    Raises:
        ValueError: an unknown kind, ``bits`` not 4 or 8, or a signed map without zero.
    """
    return torch.tensor(_map_values(kind, bits, signed), dtype=torch.float32)


def format_map(fmt: StateFormat, signed: bool) -> Tuple[Tensor, int]:
    """A blockwise format's code map for ``exp_avg`` (``signed``) or ``exp_avg_sq``, and its
    block size, as ``state_formats.py`` declares them.

    Raises:
        ValueError: ``fmt`` is not blockwise.
    """
    if not fmt.blockwise:
        raise ValueError(f"the {fmt.name!r} format stores no codes")
    return code_map(fmt.maps[0] if signed else fmt.maps[1], fmt.bits, signed), fmt.block_size


def _midpoints(qmap: Tensor) -> Tensor:
    return (qmap[:-1] + qmap[1:]) * 0.5


# The compiled kernels' code search (csrc/quant.h: nearest_code_in) starts from a table of the
# midpoints per range of fp32 bit patterns: the top SEARCH_KEY_BITS of an order-preserving
# transform of y's bits (sign, exponent, 4 mantissa bits) name a bucket, whose entry says which
# midpoints lie in it. The midpoints below the bucket are below y and those above it above y (the
# key never decreases as y grows), so a few compares inside the bucket finish the count: the same
# number torch.searchsorted gives, in a few steps instead of one per code bit.
SEARCH_KEY_BITS = 13


def search_keys(y: Tensor) -> Tensor:
    """The bucket of each fp32 ``y`` (int64): ``-0.0`` as ``+0.0``; negative values' bits inverted,
    the others' sign bit set, so the keys order as the values; then the top ``SEARCH_KEY_BITS``."""
    y = torch.where(y == 0, torch.zeros_like(y), y.float())
    bits = y.view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    ordered = torch.where(bits >= 0x80000000, 0xFFFFFFFF - bits, bits | 0x80000000)
    return ordered >> (32 - SEARCH_KEY_BITS)


def search_table(mids: Tensor) -> Tensor:
    """int32 ``[2**SEARCH_KEY_BITS + 1]`` on ``mids``' device: entry ``b`` holds the number of
    midpoints in buckets below ``b`` (low 16 bits) and in ``b`` (high 16 bits); the last entry the
    largest power of two not above any bucket's count (the search's first step; 0 if none holds
    two). ``mids``: sorted fp32 midpoints (``_midpoints``)."""
    keys = search_keys(mids.cpu())
    buckets = torch.arange(1 << SEARCH_KEY_BITS, dtype=torch.int64)
    below = torch.searchsorted(keys, buckets, right=False)
    inside = torch.searchsorted(keys, buckets, right=True) - below
    most = int(inside.max())
    first_step = 1 << (most.bit_length() - 1) if most else 0
    table = torch.cat([below | (inside << 16), torch.tensor([first_step])])
    return table.to(torch.int32).to(mids.device)


def _check_grid(block_size: int, offset: int) -> None:
    if block_size <= 0 or block_size % 2:
        raise ValueError(f"block_size={block_size}: expected an even number > 0 (4-bit codes pair up in bytes)")
    if offset % block_size:
        raise ValueError(f"offset={offset}: a quantized piece must start on the block grid (a multiple of "
                         f"block_size={block_size}); round the shard boundaries to whole blocks")


def block_scales(x: Tensor, block_size: int, offset: int = 0) -> Tensor:
    """One fp32 absmax per block of the grid that ``x`` (the bucket's elements
    ``[offset, offset + len(x))``) covers: ``ceil(len(x) / block_size)`` of them."""
    _check_grid(block_size, offset)
    n = x.numel()
    pad = (-n) % block_size
    a = x.detach().float().abs()
    if pad:
        a = torch.cat([a, a.new_zeros(pad)])
    return a.view(-1, block_size).amax(dim=1)


def quantize(x: Tensor, qmap: Tensor, block_size: int, offset: int = 0) -> Tuple[Tensor, Tensor]:
    """Codes (uint8, one per element, unpacked) and scales (fp32, one per block) of ``x``.

    Args:
        x: 1-D, finite; >= 0 where ``qmap`` is unsigned.
        qmap: a sorted code map (``code_map``) on ``x``'s device.
        block_size: elements per block (even).
        offset: the bucket-relative index of ``x[0]``, a multiple of ``block_size``.

    Raises:
        ValueError: ``offset`` off the block grid, or an odd ``block_size``.
    """
    scales = block_scales(x, block_size, offset)
    n = x.numel()
    per_elem = scales.repeat_interleave(block_size)[:n]
    y = torch.where(per_elem > 0, x.float() / torch.where(per_elem > 0, per_elem, 1.0), 0.0)
    codes = torch.searchsorted(_midpoints(qmap), y)  # the number of midpoints below y: ties go down
    return codes.to(torch.uint8), scales


def dequantize(codes: Tensor, scales: Tensor, qmap: Tensor, block_size: int) -> Tensor:
    """The fp32 values of unpacked ``codes`` under their blocks' ``scales``."""
    n = codes.numel()
    return qmap[codes.long()] * scales.repeat_interleave(block_size)[:n]


def pack4(codes: Tensor) -> Tensor:
    """4-bit codes (uint8 < 16) two to a byte: element ``2i`` in the low nibble of byte ``i``,
    ``2i + 1`` in the high one (0 after an odd count)."""
    c = codes.to(torch.uint8)
    if c.numel() % 2:
        c = torch.cat([c, c.new_zeros(1)])
    pairs = c.view(-1, 2)
    return pairs[:, 0] | (pairs[:, 1] << 4)


def unpack4(packed: Tensor, numel: int) -> Tensor:
    """The ``numel`` codes of ``pack4``'s bytes."""
    out = torch.stack([packed & 0x0F, packed >> 4], dim=1).reshape(-1)
    return out[:numel]


def quantize_packed(x: Tensor, qmap: Tensor, bits: int, block_size: int, offset: int = 0) -> Tuple[Tensor, Tensor]:
    """``quantize``, the codes packed as the format stores them (``bits`` 8: as they are; 4: ``pack4``)."""
    codes, scales = quantize(x, qmap, block_size, offset)
    return (pack4(codes) if bits == 4 else codes), scales


def dequantize_packed(stored: Tensor, scales: Tensor, qmap: Tensor, bits: int, block_size: int,
                      numel: int) -> Tensor:
    """The fp32 values of ``numel`` elements stored by ``quantize_packed``."""
    codes = unpack4(stored, numel) if bits == 4 else stored[:numel]
    return dequantize(codes, scales, qmap, block_size)


@dataclass(eq=False)
class QuantizedShard:
    """One moment's shard in a blockwise format: ``codes`` (uint8; 4-bit packed two to a byte)
    and ``scales`` (fp32, one per block), updated in place by the step. ``offset``: the
    bucket-relative index of the shard's first element (a multiple of the block: the layout
    puts shard boundaries on the grid); ``signed``: ``exp_avg``'s map, else ``exp_avg_sq``'s.
    No fp32 copy of the values is kept: :meth:`dequantize` makes one for a step's duration."""

    fmt: StateFormat
    signed: bool
    numel: int
    offset: int
    codes: Tensor
    scales: Tensor
    _maps: Dict[object, Tensor] = field(default_factory=dict, repr=False)

    @classmethod
    def zeros(cls, fmt: StateFormat, signed: bool, numel: int, offset: int, device: torch.device) -> "QuantizedShard":
        """A zero moment (every scale 0: every element dequantizes to 0) of ``numel`` elements.

        Raises:
            ValueError: ``fmt`` is not blockwise, or ``offset`` / ``numel`` are off its block grid.
        """
        qmap, block = format_map(fmt, signed)
        if numel % block:
            raise ValueError(f"numel={numel}: a quantized shard is whole blocks of {block} elements")
        codes, scales = quantize_packed(torch.zeros(numel, device=device), qmap.to(device), fmt.bits, block, offset)
        return cls(fmt, signed, numel, offset, codes, scales)

    @property
    def dtype(self) -> torch.dtype:
        """The codes' dtype (uint8): what a kernel that takes only float moments checks."""
        return self.codes.dtype

    @property
    def device(self) -> torch.device:
        return self.codes.device

    @property
    def block_size(self) -> int:
        return self.fmt.block_size

    @property
    def nbytes(self) -> int:
        """Bytes held: codes plus scales, as allocated."""
        return self.codes.numel() * self.codes.element_size() + self.scales.numel() * self.scales.element_size()

    def _cached(self, what: str, make: Callable[[], Tensor]) -> Tensor:
        key = (what, self.codes.device)
        if key not in self._maps:
            self._maps[key] = make()
        return self._maps[key]

    def qmap(self) -> Tensor:
        """This moment's code map on the codes' device (cached)."""
        return self._cached("map", lambda: format_map(self.fmt, self.signed)[0].to(self.codes.device))

    def midpoints(self) -> Tensor:
        """The code map's midpoints on the codes' device (cached): what ``quantize`` searches,
        and what the compiled kernels are handed."""
        return self._cached("mids", lambda: _midpoints(self.qmap()))

    def search_table(self) -> Tensor:
        """The midpoints' search table on the codes' device (cached; ``search_table``): what the
        compiled kernels start their code search from."""
        return self._cached("search", lambda: search_table(self.midpoints()))

    def dequantize(self) -> Tensor:
        """The shard's fp32 values (a new tensor)."""
        return dequantize_packed(self.codes, self.scales, self.qmap(), self.fmt.bits, self.block_size, self.numel)

    def store(self, values: Tensor, keep: Optional[Tensor] = None) -> None:
        """Quantize ``values`` (fp32, ``numel`` of them) into the codes and scales in place,
        each block against its new absmax; where the 0-d bool ``keep`` is True (the step's skip
        flag, a device tensor: no host sync) the codes and scales are left as they are."""
        codes, scales = quantize_packed(values, self.qmap(), self.fmt.bits, self.block_size, self.offset)
        if keep is not None:
            codes = torch.where(keep, self.codes, codes)
            scales = torch.where(keep, self.scales, scales)
        self.codes.copy_(codes)
        self.scales.copy_(scales)

