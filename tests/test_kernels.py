"""The compiled kernels (csrc/) against the reference (optim/kernels/reference.py), called directly so the
result does not depend on SHARDAMP_KERNELS. CPU cases always run; CUDA cases need a GPU."""
from __future__ import annotations

import math

import pytest
import torch
from conftest import set_env

from shardamp.optim import kernels
from shardamp.optim.kernels import reference
from shardamp.optim.kernels.build import load_extension
from shardamp.optim.layout import Segment, SegmentTable

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU"))]
GRAD_DTYPES = [torch.float32, torch.bfloat16, torch.float16]
OUT_DTYPES = [None, torch.bfloat16, torch.float16]


@pytest.fixture(scope="session")
def exts():
    """Built once per session (and cached on disk by torch across sessions)."""
    return {}


def _ext_for(exts, device):
    if device not in exts:
        exts[device] = load_extension(cuda=(device == "cuda"))
    return exts[device]


# (start, length, param_index, group): unaligned starts, odd lengths, padding between segments,
# a segment longer than one chunk (16384), and params 2 (untouched) and 4 (never present).
SEGMENTS = [(0, 37, 0, 0), (48, 16400, 1, 1), (16453, 5, 2, 0), (16464, 1000, 3, 1), (17470, 40000, 5, 0)]
NUMEL = 57480


def _shard(device, grad_dtype, out_dtype, seed=0, numel=NUMEL, offset=0):
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


def _clone(state):
    return {k: None if v is None else v.clone() for k, v in state.items()}


def _run(fn, state, table, hparams, steps, touched, coef, found_inf, adam_w, bias, **kw):
    fn(state["grad"], state["master"], state["exp_avg"], state["exp_avg_sq"], state["model_out"], table, hparams,
       steps, touched, coef, found_inf, adam_w, bias, **kw)


def _assert_state_close(native, ref):
    for key in ("master", "exp_avg", "exp_avg_sq"):
        torch.testing.assert_close(native[key].cpu(), ref[key].cpu(), rtol=1e-5, atol=1e-6, equal_nan=True, msg=key)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("grad_dtype", GRAD_DTYPES)
@pytest.mark.parametrize("out_dtype", OUT_DTYPES)
@pytest.mark.parametrize("adam_w,bias", [(True, True), (False, True), (True, False)])
def test_adam_step_matches_reference(exts, device, grad_dtype, out_dtype, adam_w, bias):
    ext = _ext_for(exts, device)
    state, table, hparams, steps, touched = _shard(device, grad_dtype, out_dtype, seed=hash((adam_w, bias)) % 100)
    coef = torch.tensor(0.37, device=device)
    found_inf = torch.zeros((), device=device)
    before = _clone(state)
    ref = _clone(state)
    _run(reference.adam_step, ref, table.cpu(), hparams, steps, touched, coef, found_inf, adam_w, bias)
    _run(ext.adam_step, state, table, hparams, steps, touched, coef, found_inf, adam_w, bias)
    _assert_state_close(state, ref)
    # The untouched param's segment and the padding are left exactly as they were.
    for key in ("master", "exp_avg", "exp_avg_sq"):
        start, length = SEGMENTS[2][:2]
        assert torch.equal(state[key][start:start + length], before[key][start:start + length])
        assert torch.equal(state[key][37:48], before[key][37:48])
        assert not torch.equal(state[key][48:60], before[key][48:60])
    if out_dtype is not None:
        written = torch.zeros(NUMEL, dtype=torch.bool)
        for start, length, param, _ in SEGMENTS:
            if touched[param]:
                written[start:start + length] = True
        out = state["model_out"].cpu()
        # Rounded from the kernel's own fp32 master, to nearest even: exactly what .to() gives.
        assert torch.equal(out[written], state["master"].cpu()[written].to(out_dtype))
        assert out[~written].float().isnan().all()


@pytest.mark.parametrize("device", DEVICES)
def test_adam_step_fp32_model_out_and_unaligned(exts, device):
    """model_out in fp32, and every array one element off 16-byte alignment (scalar path)."""
    ext = _ext_for(exts, device)
    state, table, hparams, steps, touched = _shard(device, torch.float32, torch.float32, seed=3, offset=1)
    assert state["grad"].data_ptr() % 16 != 0
    coef, found_inf = torch.tensor(1.0, device=device), torch.zeros((), device=device)
    ref = _clone(state)
    _run(reference.adam_step, ref, table.cpu(), hparams, steps, touched, coef, found_inf, True, True)
    _run(ext.adam_step, state, table, hparams, steps, touched, coef, found_inf, True, True)
    _assert_state_close(state, ref)
    start, length = SEGMENTS[1][:2]
    assert torch.equal(state["model_out"][start:start + length], state["master"][start:start + length])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("grad_dtype", GRAD_DTYPES)
def test_adam_step_found_inf_writes_nothing(exts, device, grad_dtype):
    ext = _ext_for(exts, device)
    state, table, hparams, steps, touched = _shard(device, grad_dtype, torch.bfloat16, seed=5)
    state["grad"][100] = float("inf")
    state["grad"][200] = float("nan")
    before = _clone(state)
    _run(ext.adam_step, state, table, hparams, steps, touched, torch.tensor(0.5, device=device),
         torch.ones((), device=device), True, True)
    for key, value in state.items():
        assert torch.equal(value.view(torch.uint8), before[key].view(torch.uint8)), key  # bitwise, NaNs too


@pytest.mark.parametrize("device", DEVICES)
def test_adam_step_empty_and_cached_chunks(exts, device):
    ext = _ext_for(exts, device)
    state, table, hparams, steps, touched = _shard(device, torch.float32, None, numel=0)
    empty = torch.zeros((0, 4), dtype=torch.int64, device=device)
    coef, found_inf = torch.ones((), device=device), torch.zeros((), device=device)
    _run(ext.adam_step, state, empty, hparams, steps, touched, coef, found_inf, True, True)

    state, table, hparams, steps, touched = _shard(device, torch.float32, None, seed=9)
    chunks = ext.build_chunks(table, NUMEL, steps.numel(), hparams.shape[0]).to(device)
    assert chunks.shape[0] == sum(math.ceil(s[1] / ext.CHUNK) for s in SEGMENTS)
    ref = _clone(state)
    _run(reference.adam_step, ref, table.cpu(), hparams, steps, touched, coef, found_inf, True, True)
    _run(ext.adam_step, state, table, hparams, steps, touched, coef, found_inf, True, True, chunks=chunks)
    _assert_state_close(state, ref)
    with pytest.raises(RuntimeError, match="outside the shard"):
        ext.build_chunks(table, SEGMENTS[-1][0] + SEGMENTS[-1][1] - 1, steps.numel(), hparams.shape[0])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("chunk", [1000, 4097, "cuda", 65536])
def test_adam_step_any_chunk_size(exts, device, chunk):
    """Chunk tables of any size (SHARDAMP_CUDA_CHUNK may set one) cover every segment exactly and
    give the reference's result; unaligned chunk starts (4097) take the scalar head/tail path."""
    ext = _ext_for(exts, device)
    size = ext.CUDA_CHUNK if chunk == "cuda" else chunk
    state, table, hparams, steps, touched = _shard(device, torch.bfloat16, torch.bfloat16, seed=11)
    chunks = ext.build_chunks(table.cpu(), NUMEL, steps.numel(), hparams.shape[0], size)
    rows = []
    for start, packed in chunks.tolist():
        rows.append((start, packed & 0xFFFFFFFF, packed >> 32))
    assert all(0 < length <= size for _, length, _ in rows)
    for seg, (start, length, _, _) in enumerate(SEGMENTS):  # each segment tiled in order, no gap
        mine = [(s, n) for s, n, k in rows if k == seg]
        assert mine[0][0] == start and sum(n for _, n in mine) == length
        assert all(a + n == b for (a, n), (b, _) in zip(mine, mine[1:]))
    coef, found_inf = torch.tensor(0.8, device=device), torch.zeros((), device=device)
    ref = _clone(state)
    _run(reference.adam_step, ref, table.cpu(), hparams, steps, touched, coef, found_inf, True, True)
    _run(ext.adam_step, state, table, hparams, steps, touched, coef, found_inf, True, True, chunks=chunks.to(device))
    _assert_state_close(state, ref)


@pytest.mark.parametrize("device", DEVICES)
def test_adam_step_rejects_non_fp32_state(exts, device):
    ext = _ext_for(exts, device)
    state, table, hparams, steps, touched = _shard(device, torch.bfloat16, None)
    state["master"] = state["master"].bfloat16()
    with pytest.raises(RuntimeError, match="master must be fp32"):
        _run(ext.adam_step, state, table, hparams, steps, touched, torch.ones((), device=device),
             torch.zeros((), device=device), True, True)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("grad_dtype", GRAD_DTYPES)
@pytest.mark.parametrize("norm_type", [1.0, 2.0, 3.0, math.inf])
def test_grad_stats_matches_reference(exts, device, grad_dtype, norm_type):
    ext = _ext_for(exts, device)
    g = torch.Generator().manual_seed(int(norm_type) if math.isfinite(norm_type) else 11)
    for n in (1, 7, 1000, 70001):  # shorter than a vector, a tail, and several blocks' worth
        grad = (torch.randn(n, generator=g) * 2).to(grad_dtype).to(device)
        prior = torch.tensor([0.25, 0.0], device=device)  # accumulated into, not overwritten
        ref, out = prior.clone(), prior.clone()
        reference.grad_stats(grad, ref, norm_type)
        ext.grad_stats(grad, out, norm_type)
        torch.testing.assert_close(out.cpu(), ref.cpu(), rtol=2e-5, atol=0)
        again = prior.clone()
        ext.grad_stats(grad, again, norm_type)
        assert torch.equal(again, out)  # deterministic: same bits every call
    odd = torch.randn(1001, generator=g).to(grad_dtype).to(device)[1:]  # unaligned data pointer
    ref, out = torch.zeros(2, device=device), torch.zeros(2, device=device)
    reference.grad_stats(odd, ref, norm_type)
    ext.grad_stats(odd, out, norm_type)
    torch.testing.assert_close(out.cpu(), ref.cpu(), rtol=2e-5, atol=0)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("grad_dtype", GRAD_DTYPES)
@pytest.mark.parametrize("bad", [math.inf, -math.inf, math.nan])
@pytest.mark.parametrize("norm_type", [2.0, math.inf])
def test_grad_stats_flags_non_finite(exts, device, grad_dtype, bad, norm_type):
    ext = _ext_for(exts, device)
    grad = torch.randn(5000).to(grad_dtype).to(device)
    grad[4321] = bad
    ref, out = torch.zeros(2, device=device), torch.zeros(2, device=device)
    reference.grad_stats(grad, ref, norm_type)
    ext.grad_stats(grad, out, norm_type)
    assert out[1].item() == 1.0
    torch.testing.assert_close(out.cpu(), ref.cpu(), equal_nan=True)
    empty = torch.empty(0, dtype=grad_dtype, device=device)
    ext.grad_stats(empty, out, norm_type)  # an empty shard changes nothing
    torch.testing.assert_close(out.cpu(), ref.cpu(), equal_nan=True)


@pytest.mark.parametrize("device", DEVICES)
def test_dispatcher_uses_native_with_cached_chunks(exts, device, monkeypatch):
    """kernels.adam_step on a SegmentTable builds the chunk map once and reuses it."""
    _ext_for(exts, device)
    set_env(monkeypatch, "SHARDAMP_KERNELS", "native")
    assert kernels.backend(torch.device(device)) == "native"
    state, table, hparams, steps, touched = _shard(device, torch.bfloat16, torch.bfloat16, seed=13)
    segs = SegmentTable([Segment(s, n, p, g, 0) for s, n, p, g in SEGMENTS], table)
    coef, found_inf = torch.tensor(0.5, device=device), torch.zeros((), device=device)
    ref = _clone(state)
    _run(reference.adam_step, ref, table.cpu(), hparams, steps, touched, coef, found_inf, True, True)
    _run(kernels.adam_step, state, segs, hparams, steps, touched, coef, found_inf, True, True)
    (cached,) = [v for k, v in segs.extra.items() if k.startswith("native_chunks")]
    _run(kernels.adam_step, _clone(ref), segs, hparams, steps, touched, coef, found_inf, True, True)
    assert [v for k, v in segs.extra.items() if k.startswith("native_chunks")][0] is cached
    _assert_state_close(state, ref)
    stats = torch.zeros(2, device=device)
    kernels.grad_stats(state["grad"], stats, 2.0)
    torch.testing.assert_close(stats[0].cpu(), state["grad"].float().pow(2).sum().cpu(), rtol=1e-5, atol=0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU")
def test_cuda_graph_capture(exts):
    """Stats + step replayed from a CUDA graph: no host sync, no allocation in the native path."""
    ext = _ext_for(exts, "cuda")
    state, table, hparams, steps, touched = _shard("cuda", torch.bfloat16, torch.bfloat16, seed=17)
    chunks = ext.build_chunks(table, NUMEL, steps.numel(), hparams.shape[0]).cuda()
    coef, found_inf = torch.tensor(0.5, device="cuda"), torch.zeros((), device="cuda")
    stats = torch.zeros(2, device="cuda")
    ref = _clone(state)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm up (scratch buffers) on the capturing stream
        ext.grad_stats(state["grad"], torch.zeros(2, device="cuda"), 2.0)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        ext.grad_stats(state["grad"], stats, 2.0)
        _run(ext.adam_step, state, table, hparams, steps, touched, coef, found_inf, True, True, chunks=chunks)
    graph.replay()
    torch.cuda.synchronize()
    reference.grad_stats(ref["grad"], ref_stats := torch.zeros(2, device="cuda"), 2.0)
    _run(reference.adam_step, ref, table.cpu(), hparams, steps, touched, coef, found_inf, True, True)
    torch.testing.assert_close(stats, ref_stats, rtol=1e-5, atol=0)
    _assert_state_close(state, ref)


# ---------------------------------------------------------------- bf16 moments, param remainders
MOMENT_DTYPES = [(torch.float32, torch.bfloat16), (torch.bfloat16, torch.float32), (torch.bfloat16, torch.bfloat16)]


def _shard_states(device, grad_dtype, out_dtype, m_dtype, v_dtype, remainders=False, seed=0, offset=0):
    """_shard with the moments in ``m_dtype`` / ``v_dtype`` and, with ``remainders``, the fp32
    master split into a bf16 ``model_out`` (high halves) and an int16 ``master`` (low halves)."""
    state, table, hparams, steps, touched = _shard(device, grad_dtype, out_dtype, seed=seed, offset=offset)

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


def _master_of(state):
    if state["master"].dtype == torch.int16:
        return reference.join_remainders(state["model_out"], state["master"])
    return state["master"]


def _assert_moments_close(native, ref):
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


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("grad_dtype", GRAD_DTYPES)
@pytest.mark.parametrize("out_dtype", OUT_DTYPES)
@pytest.mark.parametrize("m_dtype,v_dtype", MOMENT_DTYPES)
def test_adam_step_bf16_moments_match_reference(exts, device, grad_dtype, out_dtype, m_dtype, v_dtype):
    ext = _ext_for(exts, device)
    state, table, hparams, steps, touched = _shard_states(device, grad_dtype, out_dtype, m_dtype, v_dtype, seed=21)
    coef, found_inf = torch.tensor(0.37, device=device), torch.zeros((), device=device)
    before, ref = _clone(state), _clone(state)
    _run(reference.adam_step, ref, table.cpu(), hparams, steps, touched, coef, found_inf, True, True)
    _run(ext.adam_step, state, table, hparams, steps, touched, coef, found_inf, True, True)
    torch.testing.assert_close(state["master"].cpu(), ref["master"].cpu(), rtol=1e-5, atol=1e-6)
    _assert_moments_close(state, ref)
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
def test_adam_step_remainders_bitwise_equal_fp32_master(exts, device, grad_dtype, m_dtype, v_dtype, offset):
    """The kernel with int16 remainders under a bf16 param computes bit for bit the masters and
    moments of the same kernel with a separate fp32 master, over several steps; the bf16 param is
    the master's high half (rounded to nearest, ties away); the reference agrees to round-off.
    offset=1 puts every array off 16-byte alignment (the scalar path)."""
    ext = _ext_for(exts, device)
    rem, table, hparams, steps, touched = _shard_states(
        device, grad_dtype, torch.bfloat16, m_dtype, v_dtype, remainders=True, seed=23, offset=offset)
    sep = _clone(rem)
    sep["master"] = reference.join_remainders(rem["model_out"], rem["master"]).clone()
    ref = _clone(rem)
    before = _clone(rem)
    found_inf = torch.zeros((), device=device)
    for k in range(4):
        coef = torch.tensor(0.3 + 0.2 * k, device=device)
        steps_k = steps + k
        for st, fn in ((rem, ext.adam_step), (sep, ext.adam_step), (ref, reference.adam_step)):
            _run(fn, st, table if fn is ext.adam_step else table.cpu(), hparams, steps_k, touched, coef,
                 found_inf, True, k % 2 == 0)
    assert torch.equal(_master_of(rem).view(torch.int32), sep["master"].view(torch.int32))
    for key in ("exp_avg", "exp_avg_sq"):
        assert torch.equal(rem[key].view(torch.int16 if rem[key].dtype == torch.bfloat16 else torch.int32),
                           sep[key].view(torch.int16 if sep[key].dtype == torch.bfloat16 else torch.int32)), key
    hi, _ = reference.split_remainders(sep["master"])
    assert torch.equal(rem["model_out"].view(torch.int16), hi.view(torch.int16))
    ours, theirs = _master_of(rem).cpu(), _master_of(ref).cpu()
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
def test_adam_step_new_states_found_inf_writes_nothing(exts, device):
    ext = _ext_for(exts, device)
    for remainders in (False, True):
        state, table, hparams, steps, touched = _shard_states(
            device, torch.float32, torch.bfloat16, torch.bfloat16, torch.bfloat16, remainders=remainders, seed=29)
        before = _clone(state)
        _run(ext.adam_step, state, table, hparams, steps, touched, torch.tensor(0.5, device=device),
             torch.ones((), device=device), True, True)
        for key, value in state.items():
            assert torch.equal(value.view(torch.uint8), before[key].view(torch.uint8)), key


@pytest.mark.parametrize("device", DEVICES)
def test_adam_step_remainders_need_bf16_model_out(exts, device):
    ext = _ext_for(exts, device)
    for out in (None, torch.float16):
        state, table, hparams, steps, touched = _shard(device, torch.float32, out)
        state["master"] = torch.zeros(NUMEL, dtype=torch.int16, device=device)
        with pytest.raises(RuntimeError, match="remainders need model_out in bf16"):
            _run(ext.adam_step, state, table, hparams, steps, touched, torch.ones((), device=device),
                 torch.zeros((), device=device), True, True)
        with pytest.raises(ValueError, match="remainders need model_out in bfloat16"):
            _run(reference.adam_step, state, table.cpu(), hparams, steps, touched, torch.ones((), device=device),
                 torch.zeros((), device=device), True, True)


@pytest.mark.parametrize("device", DEVICES)
def test_dispatcher_runs_new_states_natively(exts, device, monkeypatch):
    """kernels.adam_step sends bf16 moments and int16 remainders to the compiled kernels (not
    the reference fallback): forced native, the results equal the reference's to round-off."""
    _ext_for(exts, device)
    set_env(monkeypatch, "SHARDAMP_KERNELS", "native")
    calls = []
    monkeypatch.setattr(reference, "adam_step", lambda *a, **k: calls.append(a))
    state, table, hparams, steps, touched = _shard_states(
        device, torch.bfloat16, torch.bfloat16, torch.bfloat16, torch.float32, remainders=True, seed=31)
    segs = SegmentTable([Segment(s, n, p, g, 0) for s, n, p, g in SEGMENTS], table)
    coef, found_inf = torch.tensor(0.5, device=device), torch.zeros((), device=device)
    ref = _clone(state)
    _run(kernels.adam_step, state, segs, hparams, steps, touched, coef, found_inf, True, True)
    assert not calls
    monkeypatch.undo()
    _run(reference.adam_step, ref, table.cpu(), hparams, steps, touched, coef, found_inf, True, True)
    torch.testing.assert_close(_master_of(state).cpu(), _master_of(ref).cpu(), rtol=1e-5, atol=1e-6)
    _assert_moments_close(state, ref)


@pytest.mark.parametrize("device", DEVICES)
def test_step_scalars_match_reference_bitwise(exts, device):
    """The grad coefficient (base * scale * clip) and the step counts in one launch: bit for bit
    the reference's torch ops, for norms below, at and above max_norm, zero, inf and NaN, with
    and without a clip and a found-inf."""
    ext = _ext_for(exts, device)
    g = torch.Generator().manual_seed(3)
    touched = (torch.rand(37, generator=g) > 0.3).float().to(device)
    for norm_value in (0.0, 0.3, 1.0, 1.0 + 1e-7, 7.5, 3e38, math.inf, math.nan):
        for clip in (True, False):
            for found in (0.0, 1.0):
                for base_value, scale in ((1 / 65536, 1.0), (1 / 65536, 0.25), (0.5, 1.0 / 3.0)):
                    base = torch.tensor(base_value, device=device)
                    norm = torch.tensor(norm_value, device=device) if clip else None
                    found_inf = torch.tensor(found, device=device)
                    steps = torch.arange(37, dtype=torch.float32, device=device)
                    outs = []
                    for fn in (ext.step_scalars, reference.step_scalars):
                        coef, s = torch.empty((), device=device), steps.clone()
                        fn(coef, base, scale, norm, 0.7, found_inf, s, touched)
                        outs.append((coef, s))
                    (c_n, s_n), (c_r, s_r) = outs
                    assert torch.equal(s_n, s_r)
                    assert (math.isnan(c_r.item()) and math.isnan(c_n.item())) or c_n.item() == c_r.item(), \
                        (norm_value, clip, base_value, scale, c_n.item(), c_r.item())
                    assert 0.0 <= c_n.item() <= base_value * scale * (1 + 1e-6)


@pytest.mark.parametrize("device", DEVICES)
def test_stats_finish_matches_reference_bitwise(exts, device):
    """The reduced stats' norm, found-inf and 0/1 touched flags in one launch: bit for bit the
    reference's four torch ops (the norm: the correctly rounded root), for norm types 2 and inf, finite, zero, inf and NaN partials,
    the flag set or not, touched counts above 1 (SUM over ranks) and a NaN one, the tail beyond ``end`` left
    alone, and more touched entries than one block of threads covers."""
    ext = _ext_for(exts, device)
    g = torch.Generator().manual_seed(5)
    for n_touched in (0, 3, 161, 70000):
        counts = torch.randint(0, 4, (n_touched,), generator=g).float()
        if n_touched:
            counts[n_touched // 2] = math.nan  # kept NaN, as torch's clamp keeps it
        tail = torch.randn(9, generator=g)
        for norm_type in (2.0, math.inf):
            for partial in (0.0, 2.25, 3e38, math.inf, math.nan):
                for flag in (0.0, 1.0, 3.0):
                    stats = torch.cat([torch.tensor([partial, flag]), counts, tail]).to(device)
                    end = 2 + n_touched
                    native, ref = stats.clone(), stats.clone()
                    out = torch.full((2,), -7.0, device=device)
                    ext.stats_finish(native, end, norm_type, out)
                    raw, found = reference.stats_finish(ref, end, norm_type)
                    torch.testing.assert_close(native[2:], ref[2:], rtol=0, atol=0, equal_nan=True)
                    torch.testing.assert_close(native[:2], stats[:2], rtol=0, atol=0, equal_nan=True)  # header read only
                    # the norm is the correctly rounded root: torch's CPU sqrt is 1 ulp off for some
                    # inputs (3e38), its CUDA sqrt is IEEE; the float64 root rounded once is exact
                    exact = torch.tensor(partial, dtype=torch.float32).double()
                    exact = (exact.sqrt() if norm_type == 2.0 else exact).float()
                    torch.testing.assert_close(raw.cpu(), exact, rtol=1.2e-7, atol=0, equal_nan=True)
                    for got, want in ((out[0], exact), (out[1], found)):
                        assert (math.isnan(want.item()) and math.isnan(got.item())) or got.item() == want.item(), \
                            (norm_type, partial, flag, got.item(), want.item())
                    assert found.item() == (1.0 if flag or not math.isfinite(partial) else 0.0)
                    flags = native[2:end]
                    assert bool(((flags <= 1.0) | flags.isnan()).all()) and int(flags.isnan().sum()) == min(n_touched, 1)


@pytest.mark.parametrize("device", DEVICES)
def test_step_scalars_health_match_reference_bitwise(exts, device):
    """The step's health in the same launch: the skip (found-inf, or the unscaled norm ``raw *
    avg * inv_scale`` above ``skip_above``, never for NaN), the steps advanced by it, the fp64
    counters and the record [reason, unscaled norm]: bit for bit the reference's torch ops,
    for norms below, at and above the threshold, inf and NaN, with and without a scale."""
    ext = _ext_for(exts, device)
    touched = torch.tensor([1.0, 0.0, 1.0, 1.0], device=device)
    for raw_value in (0.0, 0.5, 2.0, 2.0 + 1e-6, 3e38, math.inf, math.nan):
        for found in (0.0, 1.0):
            for inv in (None, 0.25, 1.0):
                for above in (math.inf, 1.0, 0.5):
                    outs = []
                    for fn in (ext.step_scalars, reference.step_scalars):
                        coef, steps = torch.empty((), device=device), torch.arange(4.0, device=device)
                        counters = torch.tensor([5.0, 1.0, 2.0, 3.0], dtype=torch.float64, device=device)
                        health = dict(skip_out=torch.full((), -1.0, device=device),
                                      raw_norm=torch.tensor(raw_value, device=device),
                                      inv_scale=None if inv is None else torch.tensor(inv, device=device),
                                      avg=0.5, skip_above=above, counters=counters,
                                      record=torch.full((2,), -1.0, device=device))
                        fn(coef, torch.tensor(1.0, device=device), 1.0, None, 0.0,
                           torch.tensor(found, device=device), steps, touched, **health)
                        outs.append((steps, health["skip_out"], counters, health["record"]))
                    where = (raw_value, found, inv, above)
                    for a, b in zip(*outs):
                        torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True, msg=lambda m: f"{where}: {m}")
                    steps, skip, counters, record = outs[0]
                    unscaled = raw_value * 0.5 * (1.0 if inv is None else inv)
                    want_skip = found != 0 or unscaled > above
                    assert skip.item() == float(want_skip), where
                    assert counters.tolist() == [5.0 + (not want_skip), 1.0 + found, 2.0 + (want_skip and not found),
                                                 3.0 + 1 if want_skip else 0.0], where
                    assert record[0].item() == (1.0 if found else 2.0 if want_skip else 0.0), where


def _flag_rows(device):
    # (start, length, index): padding between rows, rows of one element, a row over several chunks
    return torch.tensor([[0, 37, 0], [48, 16400, 3], [16453, 5, 1], [16464, 1, 4], [16480, 150000, 2]],
                        dtype=torch.int64, device=device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", GRAD_DTYPES)
def test_nonfinite_flags_match_reference(exts, device, dtype):
    """Per-row non-finite flags of a flat buffer: inf, -inf and NaN in any row (first, last and
    middle elements, a one-element row, a row spanning chunks) set exactly that row's index and
    the "any" flag; padding between rows is never looked at; flags already set stay set."""
    ext = _ext_for(exts, device)
    rows = _flag_rows(device)
    numel = 16480 + 150000 + 7
    g = torch.Generator().manual_seed(11)
    cases = [[], [(0, math.inf)], [(36, -math.inf)], [(40, math.nan)], [(16464, math.nan)],
             [(48 + 16399, math.inf), (16480 + 149999, math.nan)], [(16480 + 70000, -math.inf), (16455, math.inf)],
             [(numel - 1, math.nan)]]
    for poison in cases:
        full = (torch.randn(numel, generator=g) * 100).to(dtype).to(device)
        for at, value in poison:
            full[at] = value
        for preset in (False, True):
            outs = []
            for fn in (ext.nonfinite_flags, reference.nonfinite_flags):
                flags = torch.zeros(6, device=device)
                if preset:
                    flags[0] = 1.0
                fn(full, rows, flags)
                outs.append(flags.cpu())
            assert torch.equal(outs[0], outs[1]), (poison, preset, outs)
            hit = {r[2] for r in rows.tolist() for at, _ in poison if r[0] <= at < r[0] + r[1]}
            want = torch.zeros(6)
            for i in hit | ({0} if preset else set()):
                want[i] = 1.0
            if hit:
                want[-1] = 1.0
            assert torch.equal(outs[0], want), (poison, preset, outs[0])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", GRAD_DTYPES)
@pytest.mark.parametrize("norm_type", [2.0, 1.0, 3.0, math.inf])
def test_group_partials_match_reference(exts, device, dtype, norm_type):
    """Each param group's partial of a shard (its segments in several groups, interleaved, one
    over several chunks), accumulated into ``out``: the reference's to fp32 round-off; a NaN
    propagates into its group only."""
    ext = _ext_for(exts, device)
    table = SegmentTable.build([Segment(s, n, p, grp, 0) for s, n, p, grp in
                                [(0, 37, 0, 0), (48, 16400, 1, 2), (16453, 5, 2, 0), (16464, 1000, 3, 1),
                                 (17470, 40000, 5, 2)]], torch.device(device))
    g = torch.Generator().manual_seed(2)
    grad = (torch.randn(NUMEL, generator=g) * 3).to(dtype).to(device)
    for poison in (False, True):
        if poison:
            grad[16455] = math.nan  # group 0
        outs = []
        for native in (True, False):
            out = torch.tensor([0.5, 0.25, 0.0, 7.0], device=device)  # accumulated into; group 3 has no segment
            if native:
                kernels.group_partials(grad, table, out, norm_type, 6)
            else:
                reference.group_partials(grad, table.table.cpu(), out, norm_type)
            outs.append(out.cpu())
        torch.testing.assert_close(outs[0], outs[1], rtol=2e-5, atol=0, equal_nan=True)
        assert outs[0][3] == 7.0 and bool(outs[0][0].isnan()) == poison and bool(torch.isfinite(outs[0][1:]).all())
