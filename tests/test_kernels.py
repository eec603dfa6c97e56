"""The compiled Adam step (csrc/) against the reference (optim/kernels/reference.py) with fp32
master and moments, called directly so the result does not depend on SHARDAMP_KERNELS; the
dispatcher's native path; a CUDA graph replay. CPU cases always run; CUDA cases need a GPU. The
other state kinds: test_kernels_light_state.py; the statistics and per-step scalars:
test_kernels_stats.py."""
from __future__ import annotations

import math

import pytest
import torch
from conftest import set_env

from kernel_shards import (DEVICES, GRAD_DTYPES, NUMEL, OUT_DTYPES, SEGMENTS, assert_state_close, clone_state, ext_for,
                           run_step, shard)
from shardamp.optim import kernels
from shardamp.optim.kernels import reference
from shardamp.optim.layout import Segment, SegmentTable


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("grad_dtype", GRAD_DTYPES)
@pytest.mark.parametrize("out_dtype", OUT_DTYPES)
@pytest.mark.parametrize("adam_w,bias", [(True, True), (False, True), (True, False)])
def test_adam_step_matches_reference(device, grad_dtype, out_dtype, adam_w, bias):
    ext = ext_for(device)
    state, table, hparams, steps, touched = shard(device, grad_dtype, out_dtype, seed=hash((adam_w, bias)) % 100)
    coef = torch.tensor(0.37, device=device)
    found_inf = torch.zeros((), device=device)
    before = clone_state(state)
    ref = clone_state(state)
    run_step(reference.adam_step, ref, table.cpu(), hparams, steps, touched, coef, found_inf, adam_w, bias)
    run_step(ext.adam_step, state, table, hparams, steps, touched, coef, found_inf, adam_w, bias)
    assert_state_close(state, ref)
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
def test_adam_step_fp32_model_out_and_unaligned(device):
    """model_out in fp32, and every array one element off 16-byte alignment (scalar path)."""
    ext = ext_for(device)
    state, table, hparams, steps, touched = shard(device, torch.float32, torch.float32, seed=3, offset=1)
    assert state["grad"].data_ptr() % 16 != 0
    coef, found_inf = torch.tensor(1.0, device=device), torch.zeros((), device=device)
    ref = clone_state(state)
    run_step(reference.adam_step, ref, table.cpu(), hparams, steps, touched, coef, found_inf, True, True)
    run_step(ext.adam_step, state, table, hparams, steps, touched, coef, found_inf, True, True)
    assert_state_close(state, ref)
    start, length = SEGMENTS[1][:2]
    assert torch.equal(state["model_out"][start:start + length], state["master"][start:start + length])


@pytest.mark.parametrize("offset", [0, 1])
@pytest.mark.parametrize("out_dtype", [None, torch.float32])
@pytest.mark.parametrize("adam_w,bias,beta1", [(True, True, 0.9), (False, True, 0.9), (True, False, 0.3),
                                               (False, False, 0.3)])
def test_adam_step_fp32_cpu_is_bitwise_the_reference(offset, out_dtype, adam_w, bias, beta1):
    """fp32 grads, master and moments on the CPU: bit for bit the reference (whatever vector width
    the build's update runs at: 256 bits in the AVX-512 build, csrc/cpu/adam_vec.h), both of
    torch.lerp's formulas (beta1 above and below 0.5), aligned and one element off."""
    ext = ext_for("cpu")
    state, table, hparams, steps, touched = shard("cpu", torch.float32, out_dtype, seed=5, offset=offset)
    hparams = hparams.clone()
    hparams[:, 1] = beta1
    coef, found_inf = torch.tensor(0.37), torch.zeros(())
    ref = clone_state(state)
    run_step(reference.adam_step, ref, table, hparams, steps, touched, coef, found_inf, adam_w, bias)
    run_step(ext.adam_step, state, table, hparams, steps, touched, coef, found_inf, adam_w, bias)
    for key in ("master", "exp_avg", "exp_avg_sq"):
        assert torch.equal(state[key].view(torch.int32), ref[key].view(torch.int32)), key
    if out_dtype is not None:
        start, length = SEGMENTS[1][:2]
        assert torch.equal(state["model_out"][start:start + length], state["master"][start:start + length])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("grad_dtype", GRAD_DTYPES)
def test_adam_step_found_inf_writes_nothing(device, grad_dtype):
    ext = ext_for(device)
    state, table, hparams, steps, touched = shard(device, grad_dtype, torch.bfloat16, seed=5)
    state["grad"][100] = float("inf")
    state["grad"][200] = float("nan")
    before = clone_state(state)
    run_step(ext.adam_step, state, table, hparams, steps, touched, torch.tensor(0.5, device=device),
         torch.ones((), device=device), True, True)
    for key, value in state.items():
        assert torch.equal(value.view(torch.uint8), before[key].view(torch.uint8)), key  # bitwise, NaNs too


@pytest.mark.native_raises
@pytest.mark.parametrize("device", DEVICES)
def test_adam_step_empty_and_cached_chunks(device):
    ext = ext_for(device)
    state, table, hparams, steps, touched = shard(device, torch.float32, None, numel=0)
    empty = torch.zeros((0, 4), dtype=torch.int64, device=device)
    coef, found_inf = torch.ones((), device=device), torch.zeros((), device=device)
    run_step(ext.adam_step, state, empty, hparams, steps, touched, coef, found_inf, True, True)

    state, table, hparams, steps, touched = shard(device, torch.float32, None, seed=9)
    chunks = ext.build_chunks(table, NUMEL, steps.numel(), hparams.shape[0]).to(device)
    assert chunks.shape[0] == sum(math.ceil(s[1] / ext.CHUNK) for s in SEGMENTS)
    ref = clone_state(state)
    run_step(reference.adam_step, ref, table.cpu(), hparams, steps, touched, coef, found_inf, True, True)
    run_step(ext.adam_step, state, table, hparams, steps, touched, coef, found_inf, True, True, chunks=chunks)
    assert_state_close(state, ref)
    with pytest.raises(RuntimeError, match="outside the shard"):
        ext.build_chunks(table, SEGMENTS[-1][0] + SEGMENTS[-1][1] - 1, steps.numel(), hparams.shape[0])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("chunk", [1000, 4097, "cuda", 65536])
def test_adam_step_any_chunk_size(device, chunk):
    """Chunk tables of any size (SHARDAMP_CUDA_CHUNK may set one) cover every segment exactly and
    give the reference's result; unaligned chunk starts (4097) take the scalar head/tail path."""
    ext = ext_for(device)
    size = ext.CUDA_CHUNK if chunk == "cuda" else chunk
    state, table, hparams, steps, touched = shard(device, torch.bfloat16, torch.bfloat16, seed=11)
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
    ref = clone_state(state)
    run_step(reference.adam_step, ref, table.cpu(), hparams, steps, touched, coef, found_inf, True, True)
    run_step(ext.adam_step, state, table, hparams, steps, touched, coef, found_inf, True, True, chunks=chunks.to(device))
    assert_state_close(state, ref)


@pytest.mark.native_raises
@pytest.mark.parametrize("device", DEVICES)
def test_adam_step_rejects_non_fp32_state(device):
    ext = ext_for(device)
    state, table, hparams, steps, touched = shard(device, torch.bfloat16, None)
    state["master"] = state["master"].bfloat16()
    with pytest.raises(RuntimeError, match="master must be fp32"):
        run_step(ext.adam_step, state, table, hparams, steps, touched, torch.ones((), device=device),
             torch.zeros((), device=device), True, True)


@pytest.mark.parametrize("device", DEVICES)
def test_dispatcher_uses_native_with_cached_chunks(device, monkeypatch):
    """kernels.adam_step on a SegmentTable builds the chunk map once and reuses it."""
    ext_for(device)
    set_env(monkeypatch, "SHARDAMP_KERNELS", "native")
    assert kernels.backend(torch.device(device)) == "native"
    state, table, hparams, steps, touched = shard(device, torch.bfloat16, torch.bfloat16, seed=13)
    segs = SegmentTable([Segment(s, n, p, g, 0) for s, n, p, g in SEGMENTS], table)
    coef, found_inf = torch.tensor(0.5, device=device), torch.zeros((), device=device)
    ref = clone_state(state)
    run_step(reference.adam_step, ref, table.cpu(), hparams, steps, touched, coef, found_inf, True, True)
    run_step(kernels.adam_step, state, segs, hparams, steps, touched, coef, found_inf, True, True)
    (cached,) = [v for k, v in segs.extra.items() if k.startswith("native_chunks")]
    run_step(kernels.adam_step, clone_state(ref), segs, hparams, steps, touched, coef, found_inf, True, True)
    assert [v for k, v in segs.extra.items() if k.startswith("native_chunks")][0] is cached
    assert_state_close(state, ref)
    stats = torch.zeros(2, device=device)
    kernels.grad_stats(state["grad"], stats, 2.0)
    torch.testing.assert_close(stats[0].cpu(), state["grad"].float().pow(2).sum().cpu(), rtol=1e-5, atol=0)


def _launches(device, seeds, grad_dtype=torch.bfloat16):
    """One kernels.AdamLaunch per seed over shard()'s layout (their own state), each shard's
    segments belonging to other params and groups (the records of each shard differ), and each
    grad."""
    launches, grads = [], []
    for k, seed in enumerate(seeds):
        state, _table, hparams, steps, touched = shard(device, grad_dtype, torch.bfloat16, seed=seed)
        rows = [(s, n, (p + k) % 6, g ^ (k & 1)) for s, n, p, g in SEGMENTS]
        table = torch.tensor(rows, dtype=torch.int64, device=device)
        segs = SegmentTable([Segment(s, n, p, g, 0) for s, n, p, g in rows], table)
        launches.append(kernels.AdamLaunch(None, state["master"], state["exp_avg"], state["exp_avg_sq"],
                                           state["model_out"], segs, hparams, steps, touched,
                                           torch.tensor(0.5, device=device), torch.zeros((), device=device), True, True))
        grads.append(state["grad"])
    return launches, grads, hparams, steps, touched


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("backend", ["native", "reference"])
@pytest.mark.parametrize("prepared", [False, True])
def test_launch_adam_all_runs_each_shard_as_its_own_step(device, backend, prepared, monkeypatch):
    """kernels.launch_adam_all (the step's launches, one native call where the kernels are
    built) updates each shard as kernels.adam_step alone would, in the given order, skipping
    none and touching no other; each launch lets go of its grad shard afterwards. ``prepared``:
    the per-segment records of all shards are formed in the same call (CUDA; none on the CPU)."""
    ext_for(device)
    set_env(monkeypatch, "SHARDAMP_KERNELS", backend)
    launches, grads, hparams, steps, touched = _launches(device, seeds=(3, 4, 5))
    records = None
    if prepared:
        records = kernels.prepare([launch.segments for launch in launches], [NUMEL] * 3, torch.device(device),
                                  len(steps), hparams.shape[0])
        assert (records.table is not None) == (device == "cuda" and backend == "native")
        for launch, offset in zip(launches, records.offsets):
            launch.record_offset = offset
    want = []
    for launch, grad in zip(launches, grads):
        ref = {"grad": grad, "master": launch.master.clone(), "exp_avg": launch.exp_avg.clone(),
               "exp_avg_sq": launch.exp_avg_sq.clone(), "model_out": launch.model_out.clone()}
        run_step(reference.adam_step, ref, launch.segments.table.cpu(), hparams, steps, touched, launch.grad_coef,
                 launch.found_inf, True, True)
        want.append(ref)
    for launch, ref in zip(launches, want):  # two steps: the second runs the launches as the first prepared them
        run_step(reference.adam_step, ref, launch.segments.table.cpu(), hparams, steps, touched,
                 launch.grad_coef, launch.found_inf, True, True)
    untouched = {k: getattr(launches[1], k).clone() for k in ("master", "exp_avg", "exp_avg_sq")}
    calls = []
    if backend == "native":
        ext = kernels.native_module(torch.device(device))
        real = ext.adam_launch_all
        monkeypatch.setattr(ext, "adam_launch_all", lambda *a, **k: (calls.append(len(a[0])), real(*a, **k)))
    for _ in range(2):
        kernels.launch_adam_all(launches, [2, 0], grads, hparams, touched, launches[0].found_inf, prepare=records)
        assert all(launch.grad is None for launch in launches)
        if backend == "native":  # released by the native launches too
            assert all(launch._native.grad is None for launch in (launches[0], launches[2]))
    assert calls == ([2, 2] if backend == "native" else [])
    for i in (0, 2):
        got = {k: getattr(launches[i], k) for k in ("master", "exp_avg", "exp_avg_sq")}
        assert_state_close(got, want[i])
        torch.testing.assert_close(launches[i].model_out.cpu(), want[i]["model_out"].cpu(), equal_nan=True)
    for k, v in untouched.items():  # launch 1 was not in the order
        assert torch.equal(getattr(launches[1], k).cpu(), v.cpu()), k


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU")
def test_cuda_graph_capture():
    """Stats + step replayed from a CUDA graph: no host sync, no allocation in the native path."""
    ext = ext_for("cuda")
    state, table, hparams, steps, touched = shard("cuda", torch.bfloat16, torch.bfloat16, seed=17)
    chunks = ext.build_chunks(table, NUMEL, steps.numel(), hparams.shape[0]).cuda()
    coef, found_inf = torch.tensor(0.5, device="cuda"), torch.zeros((), device="cuda")
    stats = torch.zeros(2, device="cuda")
    ref = clone_state(state)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm up (scratch buffers) on the capturing stream
        ext.grad_stats(state["grad"], torch.zeros(2, device="cuda"), 2.0)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        ext.grad_stats(state["grad"], stats, 2.0)
        run_step(ext.adam_step, state, table, hparams, steps, touched, coef, found_inf, True, True, chunks=chunks)
    graph.replay()
    torch.cuda.synchronize()
    reference.grad_stats(ref["grad"], ref_stats := torch.zeros(2, device="cuda"), 2.0)
    run_step(reference.adam_step, ref, table.cpu(), hparams, steps, touched, coef, found_inf, True, True)
    torch.testing.assert_close(stats, ref_stats, rtol=1e-5, atol=0)
    assert_state_close(state, ref)
