"""The kernel dispatcher's environment knobs (SHARDAMP_CUDA_CHUNK, SHARDAMP_CUDA_STEP) and the
CUDA chunk size each state kind gets: validated values, never a silent fallback."""
from __future__ import annotations

import pytest
import torch

from conftest import set_env

from shardamp.optim import config
from shardamp.optim import kernels
from shardamp.optim.kernels import dispatch
from shardamp.optim.kernels import launch_config


def test_cuda_chunk_knob(monkeypatch):
    monkeypatch.delenv("SHARDAMP_CUDA_CHUNK", raising=False)
    config.reload()
    assert launch_config.cuda_chunk(4096) == 4096
    set_env(monkeypatch, "SHARDAMP_CUDA_CHUNK", "8192")
    assert launch_config.cuda_chunk(4096) == 8192
    for bad in ("0", "-5", "4k", "1.5"):
        with pytest.raises(ValueError, match="SHARDAMP_CUDA_CHUNK"):
            set_env(monkeypatch, "SHARDAMP_CUDA_CHUNK", bad)


def test_cuda_step_shape_knob(monkeypatch):
    monkeypatch.delenv("SHARDAMP_CUDA_STEP", raising=False)
    config.reload()
    assert launch_config.cuda_step_shape() == ""
    for ok in launch_config.CUDA_STEP_SHAPES:
        set_env(monkeypatch, "SHARDAMP_CUDA_STEP", ok)
        assert launch_config.cuda_step_shape() == ok
    for bad in ("4x2", " 2x1", "c2x3"):
        with pytest.raises(ValueError, match="SHARDAMP_CUDA_STEP"):
            set_env(monkeypatch, "SHARDAMP_CUDA_STEP", bad)


def test_knobs_are_read_once(monkeypatch):
    """Both knobs are read from the environment once (shardamp.optim.config; ``config.reload()``
    re-reads it), and the dispatcher caches them, not reading them at every launch."""
    try:
        monkeypatch.setenv("SHARDAMP_CUDA_STEP", "1x4")
        monkeypatch.setenv("SHARDAMP_CUDA_CHUNK", "2048")
        config.reload()
        assert launch_config.refresh_knobs() == (launch_config.CUDA_STEP_SHAPES.index("1x4") + 1, 2048)
        monkeypatch.setenv("SHARDAMP_CUDA_STEP", "2x1")
        assert launch_config.knobs() == (launch_config.CUDA_STEP_SHAPES.index("1x4") + 1, 2048)  # still the cached read
        assert config.settings().cuda_step == "1x4"  # the environment is not read again
        with pytest.raises(ValueError, match="SHARDAMP_CUDA_STEP"):
            set_env(monkeypatch, "SHARDAMP_CUDA_STEP", "4x2")
    finally:
        monkeypatch.undo()
        config.reload()
        launch_config.refresh_knobs()  # back to what the environment says


def test_light_state_chunk_sizes():
    """Each state kind's CUDA chunk size (csrc/NOTES.md): 0 (CUDA_CHUNK) for fp32 states."""
    f, b, r = (torch.empty(1, dtype=d) for d in (torch.float32, torch.bfloat16, torch.int16))
    light_state = launch_config.light_state
    assert light_state(f, f, f) == 0
    assert light_state(f, b, b) == light_state(f, b, b, torch.float32) == 2048
    assert launch_config.BF16_MOMENTS_FP32_GRADS_CUDA_CHUNK == 2048
    assert light_state(f, b, b, torch.bfloat16) == light_state(f, b, b, torch.float16) == 4096
    assert launch_config.BF16_MOMENTS_CUDA_CHUNK == 4096
    assert light_state(r, f, f) == light_state(r, b, b) == launch_config.REMAINDERS_CUDA_CHUNK == 4096
    assert light_state(f, f, b) == light_state(r, b, f) == launch_config.LIGHT_STATE_CUDA_CHUNK == 8192


CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
# (grad, model_out, exp_avg, exp_avg_sq, remainders): kinds SHARDAMP_CUDA_STEP reaches
TUNED_KINDS = [(torch.float32, None, torch.bfloat16, torch.bfloat16, False),
               (torch.bfloat16, None, torch.bfloat16, torch.bfloat16, False),
               (torch.bfloat16, torch.bfloat16, torch.bfloat16, torch.bfloat16, False),
               (torch.bfloat16, torch.bfloat16, torch.float32, torch.float32, True),
               (torch.bfloat16, torch.bfloat16, torch.bfloat16, torch.bfloat16, True)]


def _bits(state):
    return [None if t is None else t.view(torch.int16 if t.element_size() == 2 else torch.int32).clone()
            for t in (state["master"], state["exp_avg"], state["exp_avg_sq"], state["model_out"])]


@CUDA
@pytest.mark.parametrize("kind", TUNED_KINDS)
def test_cuda_step_shapes_are_bitwise_equal(kind):
    """Every launch shape (adam_step's ``shape``: SHARDAMP_CUDA_STEP's codes) and chunk size
    computes the same bits as the kind's own shape: the split of the work changes no arithmetic."""
    from kernel_shards import run_step, shard_states

    ext = dispatch._native(torch.device("cuda"))
    results = []
    for shape in range(len(launch_config.CUDA_STEP_SHAPES) + 1):
        for chunk in (2048, 16384):
            state, table, hparams, steps, touched = shard_states("cuda", *kind[:4], remainders=kind[4], seed=7)
            chunks = ext.build_chunks(table.cpu(), state["grad"].numel(), steps.numel(), hparams.shape[0], chunk)
            for _ in range(2):
                run_step(ext.adam_step, state, table, hparams, steps, touched, torch.tensor(0.5, device="cuda"),
                     torch.zeros((), device="cuda"), True, True, chunks=chunks.cuda(), shape=shape)
            results.append(((shape, chunk), _bits(state)))
    (_, ref), rest = results[0], results[1:]
    for key, got in rest:
        assert all((a is None and b is None) or torch.equal(a, b) for a, b in zip(got, ref)), key


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=CUDA)])
def test_one_prepare_for_several_shards(device):
    """StepRecords: one prepare launch for two shards' segments (CUDA), each shard's step reading
    its rows from its offset, gives the bits of each shard's own prepare; on the CPU there is
    nothing to prepare (the step forms its scalars per chunk)."""
    from kernel_shards import SEGMENTS, run_step, shard_states
    from shardamp.optim.layout import Segment, SegmentTable

    made = [shard_states(device, torch.float32, None, torch.bfloat16, torch.bfloat16, seed=s) for s in (3, 4)]
    hparams, steps, touched = made[0][2], made[0][3], made[0][4]
    tables = []
    for k, (_, table, *_rest) in enumerate(made):
        rows = SEGMENTS if k == 0 else [(s, n, (p + 1) % 6, 1 - g) for s, n, p, g in SEGMENTS]  # other params, groups
        tables.append(SegmentTable([Segment(s, n, p, g, 0) for s, n, p, g in rows],
                                   torch.tensor(rows, dtype=torch.int64, device=device)))
    records = kernels.prepare(tables, [m[0]["grad"].numel() for m in made], torch.device(device), 6, 2)
    coef, found_inf = torch.tensor(0.37, device=device), torch.zeros((), device=device)
    rec = records.compute(hparams, steps, touched, coef, found_inf, True)
    assert (rec is None) == (device == "cpu")
    assert records.offsets == [0, len(SEGMENTS)]
    if rec is not None:  # formed in the one buffer the records keep, every step the same
        assert rec.data_ptr() == records.records.data_ptr() and rec.numel() == 2 * len(SEGMENTS) * 12
        again = records.compute(hparams, steps, touched, coef, found_inf, True)
        assert again.data_ptr() == rec.data_ptr()
    for k, (state, *_rest) in enumerate(made):
        own = {key: None if t is None else t.clone() for key, t in state.items()}
        run_step(kernels.adam_step, state, tables[k], hparams, steps, touched, coef, found_inf, True, True,
             records=rec, record_offset=records.offsets[k])
        run_step(kernels.adam_step, own, tables[k], hparams, steps, touched, coef, found_inf, True, True)
        assert all((a is None and b is None) or torch.equal(a, b) for a, b in zip(_bits(state), _bits(own))), k


@pytest.mark.native_raises
@pytest.mark.skipif(kernels.backend(torch.device("cpu")) != "native", reason="needs the compiled kernels")
def test_prepare_into_a_buffer_checks_it():
    """adam_prepare's ``out`` (StepRecords' buffer) must hold a record per segment, fp32 and
    contiguous and 16-byte aligned (the kernels read a record as three float4): a wrong one is
    refused by name before anything runs."""
    ext = kernels.native_module(torch.device("cpu"))
    table = torch.zeros((3, 4), dtype=torch.int64)
    hparams = torch.zeros((1, 5), dtype=torch.float64)
    steps, touched = torch.zeros(1), torch.ones(1)
    coef, found_inf = torch.ones(()), torch.zeros(())
    for bad in (torch.empty(3 * 12 - 1), torch.empty(3 * 12, dtype=torch.float64), torch.empty(3 * 24)[::2],
                torch.empty(3 * 12 + 1)[1:]):  # short, fp64, strided, 4 bytes off a 16-byte boundary
        with pytest.raises(RuntimeError, match="adam_prepare: out must be a contiguous, 16-byte aligned fp32 tensor "
                                               "of at least 36"):
            ext.adam_prepare(table, hparams, steps, touched, coef, found_inf, True, bad)
    with pytest.raises(RuntimeError, match="adam_prepare: CUDA tensors only"):  # a fitting buffer: the device's turn
        ext.adam_prepare(table, hparams, steps, touched, coef, found_inf, True, torch.empty(36))


@pytest.mark.native_raises
@pytest.mark.skipif(kernels.backend(torch.device("cpu")) != "native", reason="needs the compiled kernels")
def test_records_without_their_table_are_refused_before_the_step_runs(monkeypatch):
    """The step's native call forms its records into ``records`` from ``prepare`` (the segment
    table): records alone would be the last step's, read as this step's. Refused before the
    step's first kernel: the step counts and the health counters stay as they were."""
    from shardamp.optim import DistributedFusedAdam

    ext = kernels.native_module(torch.device("cpu"))
    real, seen = ext.stats_step, {}

    def capture(*args):
        seen["args"] = args
        return real(*args)

    monkeypatch.setattr(ext, "stats_step", capture)
    model = torch.nn.Linear(4, 3)
    opt = DistributedFusedAdam(model.parameters(), lr=0.1)
    opt.zero_grad()
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    args = seen["args"]
    steps, counters = args[10], args[15]  # stats_step's positional step counts and health counters
    before = steps.clone(), counters.clone()
    assert float(steps.sum()) == 2  # the call was made, and advanced both params' counts
    with pytest.raises(RuntimeError, match="records is the buffer prepare forms them into"):
        real(*args[:-2], None, torch.zeros(24))
    assert torch.equal(steps, before[0]) and torch.equal(counters, before[1])
