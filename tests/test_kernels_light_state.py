"""The compiled Adam step (csrc/) with the lighter state kinds against the reference
(optim/kernels/reference.py): bf16 moments, and int16 param remainders under a bf16 param (bit for
bit the step with a separate fp32 master); the dispatcher sends both to the compiled kernels. CPU
cases always run; CUDA cases need a GPU."""
from __future__ import annotations

import pytest
import torch
from conftest import set_env

from kernel_shards import (DEVICES, GRAD_DTYPES, MOMENT_DTYPES, NUMEL, OUT_DTYPES, SEGMENTS, assert_moments_close,
                           clone_state, ext_for, master_of, run_step, shard, shard_states)
from shardamp.optim import kernels
from shardamp.optim.kernels import reference
from shardamp.optim.layout import Segment, SegmentTable


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("grad_dtype", GRAD_DTYPES)
@pytest.mark.parametrize("out_dtype", OUT_DTYPES)
@pytest.mark.parametrize("m_dtype,v_dtype", MOMENT_DTYPES)
def test_adam_step_bf16_moments_match_reference(device, grad_dtype, out_dtype, m_dtype, v_dtype):
    ext = ext_for(device)
    state, table, hparams, steps, touched = shard_states(device, grad_dtype, out_dtype, m_dtype, v_dtype, seed=21)
    coef, found_inf = torch.tensor(0.37, device=device), torch.zeros((), device=device)
    before, ref = clone_state(state), clone_state(state)
    run_step(reference.adam_step, ref, table.cpu(), hparams, steps, touched, coef, found_inf, True, True)
    run_step(ext.adam_step, state, table, hparams, steps, touched, coef, found_inf, True, True)
    torch.testing.assert_close(state["master"].cpu(), ref["master"].cpu(), rtol=1e-5, atol=1e-6)
    assert_moments_close(state, ref)
    start, length = SEGMENTS[2][:2]  # the untouched param and the padding stay as they were
    for key in ("master", "exp_avg", "exp_avg_sq"):
        assert torch.equal(state[key][start:start + length], before[key][start:start + length])
        assert torch.equal(state[key][37:48], before[key][37:48])
        assert not torch.equal(state[key][48:60], before[key][48:60])
    if out_dtype is not None:
        out = state["model_out"].cpu()
        assert torch.equal(out[48:60], state["master"].cpu()[48:60].to(out_dtype))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("grad_dtype", GRAD_DTYPES)
@pytest.mark.parametrize("m_dtype,v_dtype", [(torch.float32, torch.float32)] + MOMENT_DTYPES)
@pytest.mark.parametrize("offset", [0, 1])
def test_adam_step_remainders_bitwise_equal_fp32_master(device, grad_dtype, m_dtype, v_dtype, offset):
    """The kernel with int16 remainders under a bf16 param computes bit for bit the masters and
    moments of the same kernel with a separate fp32 master, over several steps; the bf16 param is
    the master's high half (rounded to nearest, ties away); the reference agrees to round-off.
    offset=1 puts every array off 16-byte alignment (the scalar path)."""
    ext = ext_for(device)
    rem, table, hparams, steps, touched = shard_states(
        device, grad_dtype, torch.bfloat16, m_dtype, v_dtype, remainders=True, seed=23, offset=offset)
    sep = clone_state(rem)
    sep["master"] = reference.join_remainders(rem["model_out"], rem["master"]).clone()
    ref = clone_state(rem)
    before = clone_state(rem)
    found_inf = torch.zeros((), device=device)
    for k in range(4):
        coef = torch.tensor(0.3 + 0.2 * k, device=device)
        steps_k = steps + k
        for st, fn in ((rem, ext.adam_step), (sep, ext.adam_step), (ref, reference.adam_step)):
            run_step(fn, st, table if fn is ext.adam_step else table.cpu(), hparams, steps_k, touched, coef,
                 found_inf, True, k % 2 == 0)
    assert torch.equal(master_of(rem).view(torch.int32), sep["master"].view(torch.int32))
    for key in ("exp_avg", "exp_avg_sq"):
        assert torch.equal(rem[key].view(torch.int16 if rem[key].dtype == torch.bfloat16 else torch.int32),
                           sep[key].view(torch.int16 if sep[key].dtype == torch.bfloat16 else torch.int32)), key
    hi, _ = reference.split_remainders(sep["master"])
    assert torch.equal(rem["model_out"].view(torch.int16), hi.view(torch.int16))
    ours, theirs = master_of(rem).cpu(), master_of(ref).cpu()
    if m_dtype == v_dtype == torch.float32:
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)
    else:  # a bf16 moment rounded one ulp apart in one step moves that element's later updates
        assert (~torch.isclose(ours, theirs, rtol=1e-5, atol=1e-6)).float().mean() < 1e-3
        torch.testing.assert_close(ours, theirs, rtol=1e-2, atol=1e-4)
    start, length = SEGMENTS[2][:2]
    for key in ("master", "model_out"):  # untouched param and padding: bitwise unchanged
        assert torch.equal(rem[key][start:start + length], before[key][start:start + length])
        assert torch.equal(rem[key][37:48], before[key][37:48])


@pytest.mark.parametrize("device", DEVICES)
def test_adam_step_new_states_found_inf_writes_nothing(device):
    ext = ext_for(device)
    for remainders in (False, True):
        state, table, hparams, steps, touched = shard_states(
            device, torch.float32, torch.bfloat16, torch.bfloat16, torch.bfloat16, remainders=remainders, seed=29)
        before = clone_state(state)
        run_step(ext.adam_step, state, table, hparams, steps, touched, torch.tensor(0.5, device=device),
             torch.ones((), device=device), True, True)
        for key, value in state.items():
            assert torch.equal(value.view(torch.uint8), before[key].view(torch.uint8)), key


@pytest.mark.parametrize("device", DEVICES)
def test_adam_step_remainders_need_bf16_model_out(device):
    ext = ext_for(device)
    for out in (None, torch.float16):
        state, table, hparams, steps, touched = shard(device, torch.float32, out)
        state["master"] = torch.zeros(NUMEL, dtype=torch.int16, device=device)
        with pytest.raises(RuntimeError, match="remainders need model_out in bf16"):
            run_step(ext.adam_step, state, table, hparams, steps, touched, torch.ones((), device=device),
                 torch.zeros((), device=device), True, True)
        with pytest.raises(ValueError, match="remainders need model_out in bfloat16"):
            run_step(reference.adam_step, state, table.cpu(), hparams, steps, touched, torch.ones((), device=device),
                 torch.zeros((), device=device), True, True)


@pytest.mark.parametrize("device", DEVICES)
def test_dispatcher_runs_new_states_natively(device, monkeypatch):
    """kernels.adam_step sends bf16 moments and int16 remainders to the compiled kernels (not
    the reference fallback): forced native, the results equal the reference's to round-off."""
    ext_for(device)
    set_env(monkeypatch, "SHARDAMP_KERNELS", "native")
    calls = []
    monkeypatch.setattr(reference, "adam_step", lambda *a, **k: calls.append(a))
    state, table, hparams, steps, touched = shard_states(
        device, torch.bfloat16, torch.bfloat16, torch.bfloat16, torch.float32, remainders=True, seed=31)
    segs = SegmentTable([Segment(s, n, p, g, 0) for s, n, p, g in SEGMENTS], table)
    coef, found_inf = torch.tensor(0.5, device=device), torch.zeros((), device=device)
    ref = clone_state(state)
    run_step(kernels.adam_step, state, segs, hparams, steps, touched, coef, found_inf, True, True)
    assert not calls
    monkeypatch.undo()
    run_step(reference.adam_step, ref, table.cpu(), hparams, steps, touched, coef, found_inf, True, True)
    torch.testing.assert_close(master_of(state).cpu(), master_of(ref).cpu(), rtol=1e-5, atol=1e-6)
    assert_moments_close(state, ref)
