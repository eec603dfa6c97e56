"""Blockwise quantization of the moments (optim/kernels/quant.py), the math of the "8bit" and
"4bit" formats: round trips within one code step, the zero-code rule of the 4-bit second moment,
blocks on the bucket's grid whatever the shard boundaries, 4-bit packing, edge cases."""
from __future__ import annotations

import pytest
import torch

from shardamp.optim import state_formats
from shardamp.optim.kernels import quant

CHOSEN = [(bits, signed) for bits in (4, 8) for signed in (False, True)]
_FORMATS = {8: state_formats.Q8, 4: state_formats.Q4}


def _sample(n: int, signed: bool, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    mags = 10.0 ** (torch.rand(n, generator=g) * 8 - 10)  # 8 decades inside every block
    if not signed:
        return mags
    return mags * torch.where(torch.rand(n, generator=g) < 0.5, -1.0, 1.0)


def _chosen(bits: int, signed: bool):
    return quant.format_map(_FORMATS[bits], signed)


@pytest.mark.parametrize("bits,signed", CHOSEN)
def test_round_trip_is_the_nearest_code(bits, signed):
    qmap, block = _chosen(bits, signed)
    x = _sample(5 * block + 7, signed)  # a partial last block
    codes, scales = quant.quantize(x, qmap, block)
    assert codes.dtype == torch.uint8 and int(codes.max()) < 2 ** bits
    assert scales.dtype == torch.float32 and scales.numel() == 6
    assert torch.equal(scales, torch.cat([x, x.new_zeros(-x.numel() % block)]).abs().view(-1, block).amax(1))
    back = quant.dequantize(codes, scales, qmap, block)
    per = scales.repeat_interleave(block)[:x.numel()]
    # no other code is nearer: the error is at most half the gap to either neighbour (one code step)
    err = (back - x).abs()
    y = x / per
    nearest = (qmap[None, :] - y[:, None]).abs().min(dim=1).values * per
    assert bool(((err - nearest).abs() <= 1e-6 * (per + nearest)).all())
    gaps = (qmap[1:] - qmap[:-1]).max()
    assert bool((err <= gaps * per).all())
    # each block's absmax element comes back exactly (the map holds +-1)
    for b in range(scales.numel()):
        piece = x[b * block:(b + 1) * block]
        i = int(piece.abs().argmax())
        assert back[b * block + i] == piece[i]


@pytest.mark.parametrize("bits", [4, 8])
def test_zero_code_rule(bits):
    """No exp_avg_sq code dequantizes to 0 under a scale > 0 (from fp32's smallest normal to its
    largest): required at 4 bits, chosen at 8 too (docs/low-bit-states.md), so the update of an
    element with a tiny second moment in a block with a large one stays bounded."""
    qmap, block = _chosen(bits, False)
    assert float(qmap.min()) > 0
    assert float(_chosen(bits, True)[0].abs().min()) == 0  # exp_avg keeps its zero
    scales = torch.tensor([torch.finfo(torch.float32).tiny, 1e-30, 1e-12, 1.0, 3e38])
    for s in scales:
        n = 2 ** bits
        vals = quant.dequantize(torch.arange(n).to(torch.uint8), s.reshape(1), qmap, n)
        assert bool((vals > 0).all()) and bool(torch.isfinite(vals).all()), s
    # a block with one large second moment and many tiny ones: none becomes 0, the update
    # m / (sqrt(v) + eps) never exceeds what the exact v gives by more than the map's step allows
    v = torch.full((block,), 1e-10)
    v[0] = 1e-2
    m = v.sqrt() * 0.5
    codes, sc = quant.quantize(v, qmap, block)
    vq = quant.dequantize(codes, sc, qmap, block)
    assert bool((vq > 0).all())
    upd, updq = m / (v.sqrt() + 1e-8), m / (vq.sqrt() + 1e-8)
    assert float(updq.abs().max()) <= float(upd.abs().max())
    # with zero in the map the same block's update explodes: what the rule prevents
    zmap = quant.code_map("linear", 4, False)
    vz = quant.dequantize(*quant.quantize(v, zmap, block), zmap, block)
    assert float((m / (vz.sqrt() + 1e-8)).abs().max()) > 100 * float(upd.abs().max())


@pytest.mark.parametrize("bits,signed", CHOSEN)
def test_blocks_follow_the_bucket_grid_whatever_the_shards(bits, signed):
    """Quantized in pieces cut on block boundaries (the shards of any world size), the codes and
    scales are bitwise those of the whole bucket quantized at once; off the grid it raises."""
    qmap, block = _chosen(bits, signed)
    n = 9 * block + 5
    x = _sample(n, signed, seed=3)
    whole = quant.quantize_packed(x, qmap, bits, block)
    for cuts in ([0, n], [0, 4 * block, n], [0, block, 3 * block, 8 * block, n], [0, 2 * block, 5 * block, n]):
        codes, scales = [], []
        for lo, hi in zip(cuts, cuts[1:]):
            c, s = quant.quantize_packed(x[lo:hi], qmap, bits, block, offset=lo)
            codes.append(c)
            scales.append(s)
        assert torch.equal(torch.cat(codes), whole[0]) and torch.equal(torch.cat(scales), whole[1]), cuts
    with pytest.raises(ValueError, match="start on the block grid"):
        quant.quantize(x[block // 2:], qmap, block, offset=block // 2)
    with pytest.raises(ValueError, match="even number"):
        quant.quantize(x, qmap, 7)


def test_pack_unpack_4bit():
    codes = torch.tensor([1, 15, 0, 7, 9], dtype=torch.uint8)
    packed = quant.pack4(codes)
    assert packed.tolist() == [1 | 15 << 4, 0 | 7 << 4, 9]
    assert torch.equal(quant.unpack4(packed, 5), codes)
    all_codes = torch.arange(256, dtype=torch.int64) % 16
    assert torch.equal(quant.unpack4(quant.pack4(all_codes.to(torch.uint8)), 256), all_codes.to(torch.uint8))
    qmap, block = _chosen(4, True)
    x = _sample(3 * block + 1, True)
    stored, scales = quant.quantize_packed(x, qmap, 4, block)
    assert stored.numel() == (x.numel() + 1) // 2  # half a byte per element
    codes, _ = quant.quantize(x, qmap, block)
    assert torch.equal(quant.dequantize_packed(stored, scales, qmap, 4, block, x.numel()),
                       quant.dequantize(codes, scales, qmap, block))


@pytest.mark.parametrize("bits,signed", CHOSEN)
def test_edge_cases_all_zero_denormal_extreme(bits, signed):
    qmap, block = _chosen(bits, signed)
    # an all-zero block: scale 0, and it comes back as zeros (no 0/0)
    x = torch.zeros(2 * block)
    x[block + 3] = 0.5
    codes, scales = quant.quantize(x, qmap, block)
    back = quant.dequantize(codes, scales, qmap, block)
    assert scales[0] == 0 and torch.equal(back[:block], torch.zeros(block)) and back[block + 3] == 0.5
    # denormals (not flushed) and values near fp32's largest: finite, each absmax exact
    tiny, huge = 1e-44, 3e38
    for scale in (tiny, torch.finfo(torch.float32).tiny, huge):
        x = _sample(block, signed, seed=5)
        x = x / x.abs().max() * scale
        codes, scales = quant.quantize(x, qmap, block)
        back = quant.dequantize(codes, scales, qmap, block)
        assert bool(torch.isfinite(back).all()) and scales[0] == x.abs().max(), scale
        i = int(x.abs().argmax())
        assert back[i] == x[i]
        if scale != tiny:
            step = (qmap[1:] - qmap[:-1]).max() * scales[0]
            assert bool(((back - x).abs() <= step).all())


@pytest.mark.parametrize("kind", quant.MAP_KINDS)
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("signed", [True, False])
def test_maps_are_sorted_and_span_the_unit_range(kind, bits, signed):
    if signed and kind.endswith("_nz"):
        with pytest.raises(ValueError, match="keeps its zero"):
            quant.code_map(kind, bits, signed)
        return
    qmap = quant.code_map(kind, bits, signed)
    assert qmap.numel() == 2 ** bits and bool((qmap[1:] >= qmap[:-1]).all()) and float(qmap.max()) == 1.0
    assert float(qmap.min()) >= (-1.0 if signed else 0.0)
    assert (float(qmap.min()) > 0) == kind.endswith("_nz")
    if signed and kind != "dynamic":  # the symmetric maps hold -1 as well
        assert float(qmap.min()) == -1.0


def _table_search(mids: torch.Tensor, table: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """csrc/quant.h's nearest_code_in, element by element in Python: the kernels' search."""
    keys = quant.search_keys(y)
    first = int(table[-1])
    out = []
    for key, yv in zip(keys.tolist(), y.tolist()):
        entry = int(table[key])
        pos, end = entry & 0xFFFF, (entry & 0xFFFF) + (entry >> 16)
        step = first
        while step > 0:
            if pos + step <= end and float(mids[pos + step - 1]) < yv:
                pos += step
            step >>= 1
        out.append(pos)
    return torch.tensor(out)


@pytest.mark.parametrize("kind,bits,signed", [(k, b, s) for k in quant.MAP_KINDS for b, s in CHOSEN
                                               if not (s and k.endswith("_nz"))])  # _nz: unsigned maps
def test_the_kernels_search_table_finds_torchs_searchsorted_count(kind, bits, signed):
    """The table-started search (what the compiled kernels run) gives torch.searchsorted's code for
    every midpoint, its fp32 neighbours on both sides, +-0, +-1, values beyond them and a spread
    over 10 decades: the keys order as the values, so only the bucket's own midpoints decide."""
    mids = quant._midpoints(quant.code_map(kind, bits, signed))
    table = quant.search_table(mids)
    assert table.dtype == torch.int32 and table.numel() == 2 ** quant.SEARCH_KEY_BITS + 1
    inf = torch.tensor(float("inf"))
    y = torch.cat([mids, torch.nextafter(mids, inf), torch.nextafter(mids, -inf),
                   torch.tensor([0.0, -0.0, 1.0, -1.0, 1.5, -1.5, 1e-30, -1e-30, 1e-45, -1e-45]),
                   _sample(400, signed=True, seed=3).clamp(-1, 1), torch.rand(400) * 2 - 1])
    assert torch.equal(_table_search(mids, table, y), torch.searchsorted(mids, y))
    # the search's first step covers the fullest bucket
    counts = table[:-1] >> 16
    assert int(table[-1]) <= int(counts.max()) < 2 * max(1, int(table[-1]))
