"""What the kernel tests (test_kernels*.py, test_kernel_knobs.py) share: the devices and dtypes
they run over, the compiled module per device, and a synthetic shard (segments with unaligned
starts, odd lengths and padding) in every state kind, run through any adam_step and compared with
the reference's result."""
from __future__ import annotations

import pytest
import torch

from shardamp.optim.kernels import reference
from shardamp.optim.kernels.build import load_extension

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU"))]
GRAD_DTYPES = [torch.float32, torch.bfloat16, torch.float16]
OUT_DTYPES = [None, torch.bfloat16, torch.float16]


_EXTS = {}


def ext_for(device):
    """The compiled module for ``device`` ("cpu" or "cuda"), built once per process (and cached on
    disk by torch across processes)."""
    if device not in _EXTS:
        _EXTS[device] = load_extension(cuda=(device == "cuda"))
    return _EXTS[device]


# (start, length, param_index, group): unaligned starts, odd lengths, padding between segments,
# a segment longer than one chunk (16384), and params 2 (untouched) and 4 (never present).
SEGMENTS = [(0, 37, 0, 0), (48, 16400, 1, 1), (16453, 5, 2, 0), (16464, 1000, 3, 1), (17470, 40000, 5, 0)]
NUMEL = 57480


def shard(device, grad_dtype, out_dtype, seed=0, numel=NUMEL, offset=0):
    """A shard of ``numel`` elements laid out as SEGMENTS: its state (grad, fp32 master and
    moments, ``model_out`` in ``out_dtype`` poisoned with NaN, or None), segment table,
    hyperparameters of two groups, step counts and touched flags of six params."""
    g = torch.Generator().manual_seed(seed)

    def rand(*shape, scale=1.0):
        return torch.randn(*shape, generator=g) * scale

    def flat(t, dtype):
        # ``offset`` puts the data off 16-byte alignment to reach the scalar-only path.
        buf = torch.empty(numel + offset, dtype=dtype, device=device)
        view = buf[offset:]
        view.copy_(t)
        return view

    state = {
        "grad": flat(rand(numel, scale=3.0), grad_dtype),
        "master": flat(rand(numel), torch.float32),
        "exp_avg": flat(rand(numel, scale=0.1), torch.float32),
        "exp_avg_sq": flat(rand(numel).abs() * 0.01, torch.float32),
    }
    # Poison: elements the step must not write are NaN, so a stray write shows up as a diff.
    state["model_out"] = None if out_dtype is None else flat(torch.full((numel,), float("nan")), out_dtype)
    hparams = torch.tensor(
        [[1e-3, 0.9, 0.999, 1e-8, 0.01], [3e-2, 0.5, 0.95, 1e-6, 0.1]], dtype=torch.float64, device=device
    )
    steps = torch.tensor([1, 7, 3, 1000, 2, 5], dtype=torch.float32, device=device)
    touched = torch.tensor([1, 1, 0, 1, 1, 1], dtype=torch.float32, device=device)
    table = torch.tensor(SEGMENTS, dtype=torch.int64, device=device)
    return state, table, hparams, steps, touched


def clone_state(state):
    return {k: None if v is None else v.clone() for k, v in state.items()}


def run_step(fn, state, table, hparams, steps, touched, coef, found_inf, adam_w, bias, **kw):
    """``fn`` (an adam_step: compiled, reference or dispatched) over ``state``."""
    fn(state["grad"], state["master"], state["exp_avg"], state["exp_avg_sq"], state["model_out"], table, hparams,
       steps, touched, coef, found_inf, adam_w, bias, **kw)


def assert_state_close(native, ref):
    for key in ("master", "exp_avg", "exp_avg_sq"):
        torch.testing.assert_close(native[key].cpu(), ref[key].cpu(), rtol=1e-5, atol=1e-6, equal_nan=True, msg=key)


# ---------------------------------------------------------------- bf16 moments, param remainders
MOMENT_DTYPES = [(torch.float32, torch.bfloat16), (torch.bfloat16, torch.float32), (torch.bfloat16, torch.bfloat16)]


def shard_states(device, grad_dtype, out_dtype, m_dtype, v_dtype, remainders=False, seed=0, offset=0):
    """shard() with the moments in ``m_dtype`` / ``v_dtype`` and, with ``remainders``, the fp32
    master split into a bf16 ``model_out`` (high halves) and an int16 ``master`` (low halves)."""
    state, table, hparams, steps, touched = shard(device, grad_dtype, out_dtype, seed=seed, offset=offset)

    def recast(t, dtype):
        buf = torch.empty(t.numel() + offset, dtype=dtype, device=device)[offset:]
        buf.copy_(t)
        return buf

    state["exp_avg"] = recast(state["exp_avg"], m_dtype)
    state["exp_avg_sq"] = recast(state["exp_avg_sq"], v_dtype)
    if remainders:
        hi, lo = reference.split_remainders(state["master"])
        state["model_out"], state["master"] = recast(hi, torch.bfloat16), recast(lo, torch.int16)
    return state, table, hparams, steps, touched


def master_of(state):
    if state["master"].dtype == torch.int16:
        return reference.join_remainders(state["model_out"], state["master"])
    return state["master"]


def assert_moments_close(native, ref):
    """fp32 moments to round-off; bf16 moments: the same fp32 value rounded, so at most one bf16
    ulp apart where the fp32 results straddle a rounding boundary, and almost all bitwise."""
    for key in ("exp_avg", "exp_avg_sq"):
        a, b = native[key].cpu(), ref[key].cpu()
        assert a.dtype == b.dtype
        if a.dtype == torch.float32:
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=key)
        else:
            torch.testing.assert_close(a.float(), b.float(), rtol=2 ** -7, atol=1e-6, msg=key)
            assert (a.view(torch.int16) != b.view(torch.int16)).float().mean() < 1e-3, key
