"""The one declaration of the moments' storage (optim/state_formats.py): what a user value
selects, the errors for everything else, the bytes each format holds, and that the optimizer's
buffers, memory_stats and state-dict extras are read from it."""
from __future__ import annotations

import pytest
import torch

from shardamp.optim import DistributedFusedAdam, state_formats as sf


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(7, 5), torch.nn.Linear(5, 3))


@pytest.mark.parametrize("value,state_dtype,expected", [
    (None, torch.float32, sf.FP32), (None, torch.float64, sf.FP64),
    (torch.float32, torch.float32, sf.FP32), (torch.bfloat16, torch.float32, sf.BF16),
    (torch.float32, torch.float64, sf.FP32), (torch.bfloat16, torch.float64, sf.BF16),
])
def test_user_values_select_their_format(value, state_dtype, expected):
    assert sf.resolve("exp_avg_dtype", value, state_dtype) is expected


@pytest.mark.parametrize("value", [torch.float16, torch.float64, torch.float8_e4m3fn, torch.uint8, "bf16",
                                   "bfloat16", 8, "8-bit", "2bit", [torch.float32]])
def test_other_values_raise_naming_the_accepted_ones(value):
    with pytest.raises(ValueError) as info:
        sf.resolve("exp_avg_sq_dtype", value, torch.float32)
    assert str(info.value) == (f"exp_avg_sq_dtype={value!r}: expected None (the state dtype), torch.float32, "
                               'torch.bfloat16, "8bit" or "4bit"')


@pytest.mark.parametrize("value,fmt", [("8bit", sf.Q8), ("4bit", sf.Q4)])
@pytest.mark.parametrize("option", ["exp_avg_dtype", "exp_avg_sq_dtype"])
def test_low_bit_formats_are_selected_each_moment_apart(value, fmt, option):
    assert sf.resolve(option, value, torch.float32) is fmt and sf.resolve(option, value, torch.float64) is fmt
    opt = DistributedFusedAdam(_model().parameters(), **{option: value})
    formats = opt.shard_view().formats
    assert getattr(formats, option[:-len("_dtype")]) is fmt and getattr(opt, option) == value
    other = "exp_avg_sq" if option == "exp_avg_dtype" else "exp_avg"
    assert getattr(formats, other) is sf.FP32
    assert all(b.shard_numel % fmt.block_size == 0 for b in opt._buckets)
    for f in (sf.Q8, sf.Q4):  # held as codes and scales, never as one tensor of the storage dtype
        with pytest.raises(TypeError, match="codes and block scales"):
            f.zeros(4, torch.device("cpu"))


@pytest.mark.parametrize("block", [16, 64, 512])
def test_quant_block_size_sets_every_blockwise_moment(block):
    formats = sf.resolve_moments(torch.float32, "8bit", "4bit", block)
    assert formats.exp_avg.block_size == formats.exp_avg_sq.block_size == block
    assert formats.names() == {"exp_avg": f"8bit (block {block})", "exp_avg_sq": f"4bit (block {block})"}
    assert sf.resolve_moments(torch.float32, "8bit", None, block).exp_avg_sq is sf.FP32
    opt = DistributedFusedAdam(_model().parameters(), exp_avg_dtype="4bit", quant_block_size=block)
    assert all(b.shard_numel % block == 0 and b.exp_avg.scales.numel() == b.shard_numel // block
               for b in opt._buffers)


@pytest.mark.parametrize("block,match", [
    (100, "quant_block_size=100: expected None .* or a positive multiple of 16"),
    (0, "quant_block_size=0: expected"), (-16, "quant_block_size=-16"), (True, "quant_block_size=True"),
    (64.0, "quant_block_size=64.0"),
])
def test_bad_quant_block_size_raises(block, match):
    with pytest.raises(ValueError, match=match):
        DistributedFusedAdam(_model().parameters(), exp_avg_dtype="8bit", quant_block_size=block)


def test_quant_block_size_without_a_blockwise_moment_raises():
    with pytest.raises(ValueError, match="quant_block_size=64: neither moment is blockwise; pass exp_avg_dtype"):
        DistributedFusedAdam(_model().parameters(), exp_avg_dtype=torch.bfloat16, quant_block_size=64)


def test_bytes_per_format_are_exact():
    assert [sf.FP32.nbytes(1000), sf.BF16.nbytes(1000), sf.FP64.nbytes(1000)] == [4000, 2000, 8000]
    # codes, packed two to a byte at 4 bits, plus one fp32 scale per started block
    assert sf.Q8.nbytes(1000) == 1000 + 4 * -(-1000 // sf.Q8.block_size)
    assert sf.Q4.nbytes(1001) == 501 + 4 * -(-1001 // sf.Q4.block_size)
    assert sf.Q4.extra_tensors == ("scales",) and sf.FP32.extra_tensors == ()
    assert all(f.nbytes(0) == 0 for f in sf.FORMATS.values())


def test_formats_are_frozen_and_named_as_state_dicts_record_them():
    with pytest.raises(Exception):
        sf.BF16.bits = 8  # type: ignore[misc]
    assert sf.of_dtype(torch.bfloat16) is sf.BF16 and sf.of_dtype(torch.float16) is None
    assert [sf.native_moment(d) for d in (torch.float32, torch.bfloat16, torch.float64, torch.float16)] == [
        True, True, False, False]
    assert sf.MOMENT_KEYS == ("exp_avg", "exp_avg_sq") and [m.signed for m in sf.MOMENTS] == [True, False]
    for fmt in (sf.FP32, sf.BF16, sf.FP64):
        assert fmt.name == str(fmt.storage_dtype).replace("torch.", "")


@pytest.mark.parametrize("m,v", [(None, None), (torch.bfloat16, None), (None, torch.bfloat16),
                                 (torch.bfloat16, torch.bfloat16)])
def test_optimizer_reads_the_declaration(m, v):
    opt = DistributedFusedAdam(_model().parameters(), exp_avg_dtype=m, exp_avg_sq_dtype=v)
    formats = opt.shard_view().formats
    assert (formats.exp_avg.storage_dtype, formats.exp_avg_sq.storage_dtype) == (opt.exp_avg_dtype,
                                                                                opt.exp_avg_sq_dtype)
    n = sum(b.shard_numel for b in opt._buckets)
    assert opt.memory_stats()["moments"] == formats.exp_avg.nbytes(n) + formats.exp_avg_sq.nbytes(n)
    for buf in opt._buffers:
        assert [(mo.key, f, t.dtype) for mo, f, t in buf.moments()] == [
            ("exp_avg", formats.exp_avg, formats.exp_avg.storage_dtype),
            ("exp_avg_sq", formats.exp_avg_sq, formats.exp_avg_sq.storage_dtype)]
    model = opt.shard_view().params
    loss = sum(p.sum() for p in model)
    loss.backward()
    opt.step()
    with pytest.warns(UserWarning) if (m or v) else _no_warning():
        extras = opt.state_dict()["shardamp"]
    assert {k: extras.get(k) for k in ("exp_avg_dtype", "exp_avg_sq_dtype")} == {
        "exp_avg_dtype": "bfloat16" if m else None, "exp_avg_sq_dtype": "bfloat16" if v else None}


class _no_warning:
    def __enter__(self):
        import warnings
        self._ctx = warnings.catch_warnings()
        self._ctx.__enter__()
        warnings.simplefilter("error")

    def __exit__(self, *exc):
        self._ctx.__exit__(*exc)


def test_shard_grid_is_the_blockwise_moments_block():
    F = sf.MomentFormats
    assert F(sf.FP32, sf.BF16).grid(16) == 16 and not F(sf.FP32, sf.BF16).blockwise
    assert F(sf.Q8, sf.Q4).grid(16) == 256 and F(sf.Q8, sf.Q4).blockwise
    assert F(sf.Q4, sf.Q4).grid(16) == 128
    assert F(sf.FP32, sf.Q8).grid(16) == 256
