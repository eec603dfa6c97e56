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
                                   "bfloat16", 8, [torch.float32]])
def test_other_values_raise_naming_the_accepted_ones(value):
    with pytest.raises(ValueError) as info:
        sf.resolve("exp_avg_sq_dtype", value, torch.float32)
    assert str(info.value) == (f"exp_avg_sq_dtype={value!r}: expected None (the state dtype), torch.float32 or "
                               "torch.bfloat16")


@pytest.mark.parametrize("value", ["8bit", "4bit"])
@pytest.mark.parametrize("option", ["exp_avg_dtype", "exp_avg_sq_dtype"])
def test_low_bit_formats_are_refused_until_they_work_end_to_end(value, option):
    with pytest.raises(ValueError, match=f"{option}='{value}': blockwise {value} moments are not available yet; "
                                         r"expected None \(the state dtype\), torch.float32 or torch.bfloat16"):
        DistributedFusedAdam(_model().parameters(), **{option: value})
    for fmt in (sf.Q8, sf.Q4):  # declared only: nothing allocates or saves them
        with pytest.raises(NotImplementedError, match="not available yet"):
            fmt.zeros(4, torch.device("cpu"))


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
