"""Blockwise moments (``"8bit"`` / ``"4bit"``) in state dicts: compact and lossless.

A param's entry keeps, for each blockwise moment ``k`` (``exp_avg`` / ``exp_avg_sq``):

* ``k``: the codes of the param's elements in its MEMORY order, uint8, 1-D (4-bit: two to a
  byte, the even element in the low nibble, ``quant.pack4``);
* ``k + "_scales"``: fp32, the scales of every block of the bucket's grid that the param's
  elements fall in (a param's first and last blocks may be shared with its neighbours: their
  scales are then stored with both params, the same value);
* ``k + "_block_offset"``: the param's first element's position in its first block;

and ``"param_layout"`` (``{"shape": [...], "stride": [...]}``), so the moments can be turned
back into tensors shaped like the param without the optimizer. The state dict's ``"shardamp"``
extras say how the codes read: ``k + "_quant"`` = ``{"format", "bits", "block_size", "map"}``
(the saved map, not the current declaration, decodes them).

:func:`dequantized_entry` turns such an entry into torch's (fp32 moments shaped like the param);
a load then quantizes it again into the loading optimizer's format (``write_state``): bitwise the
saved codes and scales where the layouts agree (each block's absmax element dequantizes to
exactly its scale, so the requantized block finds the same scale and codes; only a scale below
fp32's smallest normal could round differently), one rounding where they do not.
:func:`to_torch_state_dict` is the public, pure conversion to what ``torch.optim.AdamW`` loads.
"""
from __future__ import annotations

import copy
from typing import Any, Dict, Mapping, Optional, Tuple

import torch
from torch import Tensor

from ..kernels import quant
from ..layout import ParamSlot
from ..state_formats import MOMENTS, Moment, StateFormat

LAYOUT_KEY = "param_layout"
SCALES = "_scales"
BLOCK_OFFSET = "_block_offset"
QUANT = "_quant"
EXTRA_KEY = "shardamp"


def quant_info(fmt: StateFormat, moment: Moment) -> Dict[str, Any]:
    """The extras entry that says how ``moment``'s saved codes read."""
    return {"format": fmt.name, "bits": fmt.bits, "block_size": fmt.block_size,
            "map": fmt.maps[0] if moment.signed else fmt.maps[1]}


def gathered_values(stored: Any) -> Tensor:
    """What a bucket's gather carries for a blockwise moment: its codes one per element, as fp32
    (exact for 0..255, so they stack with the other states in one gather)."""
    codes = quant.unpack4(stored.codes, stored.numel) if stored.fmt.bits == 4 else stored.codes
    return codes.float()


def param_entry(moment: Moment, fmt: StateFormat, codes: Tensor, scales: Tensor, slot: ParamSlot) -> Dict[str, Any]:
    """The entry keys of a blockwise ``moment`` of ``slot``'s param from the bucket's gathered
    ``codes`` (one per element, any integer or float dtype) and ``scales`` (one per block)."""
    b = fmt.block_size
    lo, hi = slot.offset, slot.offset + slot.numel
    mine = codes[lo:hi].to(torch.uint8)
    first, end = lo // b, (hi + b - 1) // b if hi > lo else lo // b
    return {moment.key: quant.pack4(mine) if fmt.bits == 4 else mine.clone(),
            moment.key + SCALES: scales[first:end].to(torch.float32, copy=True),
            moment.key + BLOCK_OFFSET: lo - first * b}


def layout_of(slot: ParamSlot) -> Dict[str, Any]:
    return {"shape": list(slot.shape), "stride": list(slot.stride)}


def is_quantized(entry: Mapping[str, Any]) -> bool:
    """The entry holds a blockwise moment."""
    return any(m.key + SCALES in entry for m in MOMENTS)


def _info(extras: Optional[Mapping[str, Any]], moment: Moment, where: str) -> Tuple[int, int, Tensor]:
    info = (extras or {}).get(moment.key + QUANT) if isinstance(extras, Mapping) else None
    if not isinstance(info, Mapping):
        raise ValueError(f"{where}: '{moment.key}' is stored as codes and scales, but the state dict's "
                         f"'{EXTRA_KEY}' extras have no '{moment.key}{QUANT}' saying how they read")
    bits, block, kind = info.get("bits"), info.get("block_size"), info.get("map")
    if bits not in (4, 8) or not isinstance(block, int) or block <= 0 or block % 2 or kind not in quant.MAP_KINDS:
        raise ValueError(f"{where}: {EXTRA_KEY}.{moment.key}{QUANT}={dict(info)!r}: expected bits 4 or 8, an even "
                         f"block_size > 0 and a map in {quant.MAP_KINDS}")
    return bits, block, quant.code_map(kind, bits, moment.signed)


def _values(entry: Mapping[str, Any], moment: Moment, numel: int, extras: Optional[Mapping[str, Any]],
            where: str) -> Tensor:
    bits, block, qmap = _info(extras, moment, where)
    codes, scales, offset = entry.get(moment.key), entry.get(moment.key + SCALES), entry.get(moment.key + BLOCK_OFFSET)
    nbytes = (numel * bits + 7) // 8
    if not isinstance(codes, Tensor) or codes.dtype != torch.uint8 or tuple(codes.shape) != (nbytes,):
        raise ValueError(f"{where}: '{moment.key}' must be {nbytes} uint8 codes ({numel} elements at {bits} bits)")
    if not isinstance(offset, int) or not 0 <= offset < block:
        raise ValueError(f"{where}: '{moment.key}{BLOCK_OFFSET}'={offset!r}: expected an int in [0, {block})")
    nblocks = (offset + numel + block - 1) // block if numel else 0
    if not isinstance(scales, Tensor) or scales.dtype != torch.float32 or tuple(scales.shape) != (nblocks,):
        raise ValueError(f"{where}: '{moment.key}{SCALES}' must be {nblocks} float32 block scales")
    scales = scales.detach().cpu()
    if not bool(torch.isfinite(scales).all()) or bool((scales < 0).any()):
        raise ValueError(f"{where}: '{moment.key}{SCALES}' holds non-finite or negative scales (a corrupted "
                         "state dict)")
    c = codes.detach().cpu()
    c = quant.unpack4(c, numel) if bits == 4 else c
    per_elem = scales.repeat_interleave(block)[offset:offset + numel]
    return qmap[c.long()] * per_elem


def dequantized_entry(entry: Mapping[str, Any], extras: Optional[Mapping[str, Any]],
                      shape: Optional[Tuple[int, ...]] = None, where: str = "state") -> Dict[str, Any]:
    """``entry`` with each blockwise moment as torch keeps it: fp32, shaped like the param (its
    strides, from ``"param_layout"``), the scale and offset keys and the layout dropped. An entry
    without codes comes back as a shallow copy. ``shape``: the param's, checked if given.

    Raises:
        ValueError: the codes, scales, offset, layout or the extras that read them do not fit.
    """
    out = dict(entry)
    if not is_quantized(entry):
        return out
    layout = entry.get(LAYOUT_KEY)
    if not isinstance(layout, Mapping) or "shape" not in layout or "stride" not in layout:
        raise ValueError(f"{where}: has blockwise moments but no '{LAYOUT_KEY}' ({{'shape', 'stride'}})")
    pshape, pstride = tuple(int(x) for x in layout["shape"]), tuple(int(x) for x in layout["stride"])
    if shape is not None and pshape != tuple(shape):
        raise ValueError(f"{where}: '{LAYOUT_KEY}' has shape {pshape}, the param has shape {tuple(shape)}")
    numel = 1
    for d in pshape:
        numel *= d
    for moment in MOMENTS:
        out.pop(moment.key + BLOCK_OFFSET, None)
        if out.pop(moment.key + SCALES, None) is None:
            continue
        flat = _values(entry, moment, numel, extras, where)
        t = torch.empty_strided(pshape, pstride, dtype=torch.float32)
        t.as_strided((numel,), (1,), 0).copy_(flat)
        out[moment.key] = t
    out.pop(LAYOUT_KEY, None)
    return out


def to_torch_state_dict(state_dict: Mapping[str, Any]) -> Dict[str, Any]:
    """A state dict that ``torch.optim.AdamW`` (or ``Adam``) loads, from one that
    ``DistributedFusedAdam.state_dict()`` (or ``torch.load`` of it) gave: blockwise moments
    (``"8bit"`` / ``"4bit"``: codes and block scales) dequantized to fp32 tensors shaped like
    their params, in their memory format; the scale, offset and layout keys and the extras'
    ``*_quant`` entries dropped. A state dict without blockwise moments (fp32 or bf16 ones, or
    torch's own) comes back as it is (the same object). A pure function: no optimizer, no
    collective, nothing on a device is read but the tensors given; the input is not modified.

    Args:
        state_dict: a state dict of ``DistributedFusedAdam`` (any moment format, any world size).

    Returns:
        The state dict torch's AdamW loads (``state_dict`` itself where nothing is blockwise).

    Raises:
        ValueError: a blockwise moment whose codes, scales or extras do not fit together.
    """
    state = state_dict.get("state") if isinstance(state_dict, Mapping) else None
    if not isinstance(state, Mapping) or not any(isinstance(e, Mapping) and is_quantized(e) for e in state.values()):
        return state_dict  # type: ignore[return-value]
    extras = state_dict.get(EXTRA_KEY)
    out = dict(state_dict)
    out["state"] = {k: dequantized_entry(e, extras, where=f"to_torch_state_dict: state[{k!r}]")
                    for k, e in state.items()}
    if isinstance(extras, Mapping):
        out[EXTRA_KEY] = {k: copy.deepcopy(v) for k, v in extras.items() if not k.endswith(QUANT)}
    return out
