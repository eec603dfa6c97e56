"""``offload="cpu"`` (optim/offload.py, optim/shards/host_state.py): every value the constructor
refuses, with the error naming it and the fix; the buckets chosen under ``offload_fraction``; the
host's memory (``MemAvailable``, the cgroup's limit, the ranks on the host) and a failed pin,
refused before any state moves; on CPU ranks the offloaded path itself (separate host tensors, the
copies at landing, the CPU step) bitwise equal to the default run: loops A to G with clipping,
``skip_grad_norm_above``, ``no_sync``, an inf on one rank, fp32 / bf16 params, bf16 and blockwise
moments, ``offload_fraction=0.5``, at worlds 1, 2 and 3 (``cases_offload.py``; on a 2x2 hybrid
mesh: test_mesh.py with ``check_offloaded_loop``), and state dicts and
sharded checkpoints saved offloaded loaded without and with offload at other world sizes; at one process
without a clip, the offloaded step through the host state where the default one is one native call; the
construction's format check against where each bucket's state lives (blockwise moments over CUDA
params all offloaded need no CUDA kernel: decided without a GPU). (The
multi-rank agreement on the options: test_agreement.py; on a GPU: test_cuda_offload.py.)"""
from __future__ import annotations

import functools
import math
import tempfile

import pytest
import torch

import cases_checkpoint as cc
import cases_low_bit as cl
import cases_offload as co
from dist_helper import case_values, run_distributed
from shardamp.optim import DistributedFusedAdam, config, offload
from shardamp.optim.layout import Bucket
from shardamp.optim.offload import OffloadOptions, resolve_offload
from shardamp.optim.shards import host_state
from shardamp.optim.step import grad_stats


def _model(dtype=torch.float32):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(7, 5), torch.nn.Linear(5, 3)).to(dtype)


def test_default_keeps_the_state_on_the_params_device():
    options = resolve_offload(None, None, False, False)
    assert options == OffloadOptions() and not options.enabled
    assert options.agreed() == {"offload": None, "offload_fraction": None}
    opt = DistributedFusedAdam(_model().parameters(), offload=None)
    stats = opt.memory_stats()
    assert stats["master"] == 0 and stats["moments"] > 0  # fp32 params: the state as before, nothing moved
    assert stats["host_total"] == 0 and not opt._host.shards


@pytest.mark.parametrize("fraction,expected", [(None, 1.0), (1, 1.0), (0.5, 0.5), (0.0, 0.0), (1.0, 1.0)])
def test_fraction_defaults_to_one_and_takes_zero_to_one(fraction, expected):
    options = resolve_offload("cpu", fraction, False, False)
    assert options.enabled and options.offload == "cpu"
    assert options.fraction == expected and isinstance(options.fraction, float)
    assert options.agreed() == {"offload": "cpu", "offload_fraction": expected}


@pytest.mark.parametrize("value", ["gpu", "CPU", "nvme", "cuda", True, 1, torch.device("cpu")])
def test_unknown_offload_values_raise_naming_the_accepted_ones(value):
    with pytest.raises(ValueError) as info:
        DistributedFusedAdam(_model().parameters(), offload=value)
    assert str(info.value) == (
        f"offload={value!r}: expected None (the state on the params' device) or 'cpu' (each rank's owned fp32 "
        "master and moments in host memory); offloading to NVMe is not planned (docs/offload.md)")


@pytest.mark.parametrize("fraction", [0.5, 1.0, 0.0])
def test_fraction_without_offload_raises(fraction):
    with pytest.raises(ValueError, match=rf"offload_fraction={fraction} without offload: it is the share of the "
                                         r"owned state kept in host memory; pass offload='cpu' with it"):
        DistributedFusedAdam(_model().parameters(), offload_fraction=fraction)


@pytest.mark.parametrize("fraction", [-0.1, 1.5, 2, math.nan, math.inf, True, "0.5", [0.5]])
def test_fraction_outside_zero_to_one_raises(fraction):
    with pytest.raises(ValueError) as info:
        DistributedFusedAdam(_model().parameters(), offload="cpu", offload_fraction=fraction)
    assert str(info.value) == (
        f"offload_fraction={fraction!r}: expected a number from 0 to 1 (the share of each rank's owned state "
        "bytes kept in host memory, rounded to whole buckets; default 1.0)")


def test_param_remainders_with_offload_raise_saying_why():
    model = _model(torch.bfloat16)  # where remainders are valid without offload
    DistributedFusedAdam(model.parameters(), store_param_remainders=True)
    with pytest.raises(ValueError, match=r"store_param_remainders=True with offload='cpu': the host keeps the fp32 "
                                         r"master of the owned shard, so there is no master on the device to split"):
        DistributedFusedAdam(_model(torch.bfloat16).parameters(), store_param_remainders=True, offload="cpu")


@pytest.mark.parametrize("fraction", [None, 1e-9, 0.5])
def test_capturable_with_offload_raises(fraction):
    with pytest.raises(ValueError, match=r"capturable=True with offload='cpu': an offloaded step reads its grad "
                                         r"coefficient on the host .* which a CUDA graph cannot capture"):
        DistributedFusedAdam(_model().parameters(), capturable=True, offload="cpu", offload_fraction=fraction)


def test_capturable_with_nothing_offloaded_steps_as_without_offload():
    """offload_fraction=0.0 puts no bucket on the host, so a capturable step has nothing to refuse:
    it runs and gives the bits of the same optimizer without offload."""
    runs = []
    for kwargs in (dict(offload="cpu", offload_fraction=0.0), {}):
        model = _model()
        opt = DistributedFusedAdam(model.parameters(), lr=1e-2, capturable=True, **kwargs)
        assert not opt._host.shards and opt.memory_stats()["host_total"] == 0
        for step in range(3):
            model(torch.full((4, 7), 0.1 * (step + 1))).square().sum().backward()
            opt.step()
            opt.zero_grad()
        runs.append([p.detach().clone() for p in model.parameters()])
    assert all(same(a, b) for a, b in zip(*runs))
    assert not any(same(a, b) for a, b in zip(runs[0], _model().parameters()))  # the steps moved every param




# ====================================================================== one process
def _bits(t: torch.Tensor) -> torch.Tensor:
    """A float tensor's bit patterns (NaN compared as the bits it holds)."""
    return t.detach().reshape(-1).view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(_bits(a), _bits(b))


def test_buckets_chosen_from_the_first_landing_rounded_up_to_whole_buckets():
    buckets = [Bucket(i, torch.float32, torch.device("cpu"), [], numel=n) for i, n in enumerate([100, 300, 50, 50])]
    choose = functools.partial(host_state.choose_buckets, buckets, 12.0)
    assert choose(0.0) == []
    assert choose(1e-9) == [0]
    assert choose(0.2) == [0]  # 100 of 500 reaches a fifth
    assert choose(0.21) == [0, 1]  # rounded up: the next whole bucket
    assert choose(0.8) == [0, 1]
    assert choose(0.81) == [0, 1, 2]
    assert choose(1.0) == [0, 1, 2, 3]


def test_blockwise_moments_need_the_cuda_kernel_only_where_a_bucket_state_stays_on_the_gpu():
    """The construction's format check (kernels.check_formats) asks where each bucket's state lives
    (HostState.state_devices): with offload_fraction=1.0 every bucket is on the host and the CPU
    kernels step it, so "8bit" / "4bit" over CUDA params need no CUDA blockwise kernel (nor its
    tile); a bucket left on the GPU does. Decided before anything is allocated: no GPU needed."""
    import types

    from shardamp.optim import kernels
    from shardamp.optim.state_formats import resolve_moments

    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    buckets = [Bucket(i, torch.float32, cuda, [], numel=n, shard_numel=n) for i, n in enumerate([256, 512, 256])]
    formats = resolve_moments(torch.float32, "8bit", "4bit", None)
    comm = types.SimpleNamespace(gathers_params=False)

    def devices(off, fraction):
        options = resolve_offload(off, fraction, False, False)
        return host_state.HostState(options, buckets, cuda, formats, torch.float32, None, None, comm,
                                    3).state_devices()

    assert devices("cpu", 1.0) == [cpu, cpu, cpu]
    assert devices("cpu", 0.5) == [cpu, cpu, cuda]  # 768 of 1024 elements reach a half: two buckets
    assert devices("cpu", 0.0) == [cuda, cuda, cuda] == devices(None, None)
    no_kernel = None  # no CUDA module built or loaded
    kernels.check_formats(formats, devices("cpu", 1.0), no_kernel)  # all on the host: nothing refused
    try:
        config.configure(kernels="auto")  # (the reference math on the GPU would be allowed)
        for refused in (devices("cpu", 0.5), devices(None, None)):
            with pytest.raises(NotImplementedError, match=r"exp_avg_dtype='8bit', exp_avg_sq_dtype='4bit': the "
                                                          r"blockwise moment formats on CUDA need the compiled "
                                                          r"adam_step_blockwise .*offload='cpu' with "
                                                          r"offload_fraction=1.0"):
                kernels.check_formats(formats, refused, no_kernel)
    finally:
        config.configure(kernels=None)
    small_tile = types.SimpleNamespace(adam_step_blockwise=None, BLOCKWISE_CUDA_TILE=128)  # blocks of 256 > 128
    kernels.check_formats(formats, devices("cpu", 1.0), small_tile)
    with pytest.raises(ValueError, match=r"quant_block_size=256: the CUDA step over blockwise moments takes blocks"):
        kernels.check_formats(formats, devices("cpu", 0.5), small_tile)
    float_formats = resolve_moments(torch.float32, torch.bfloat16, None, None)
    kernels.check_formats(float_formats, devices(None, None), no_kernel)  # float moments: any kernels


def test_construction_checks_the_formats_where_the_state_lives(monkeypatch):
    """The optimizer asks the check with its buckets' state devices: over params it takes for CUDA
    ones (no GPU here: the device faked, no CUDA module), blockwise moments all offloaded pass the
    format check (construction goes on to the pinned host allocation, which a CPU-only torch
    cannot make), half offloaded are refused by the check."""
    from shardamp.optim import distributed_fused_adam as dfa

    monkeypatch.setattr(dfa, "params_device", lambda params: torch.device("cuda", 0))
    monkeypatch.setattr(dfa.kernels, "backend", lambda device: "reference")
    monkeypatch.setattr(dfa.kernels, "native_module", lambda device: None)
    low_bit = dict(exp_avg_dtype="8bit", exp_avg_sq_dtype="4bit", bucket_cap_mb=0.0001)
    try:
        config.configure(kernels="auto")
        with pytest.raises(RuntimeError) as info:  # past the check: the pinned allocation needs CUDA
            DistributedFusedAdam(_model().parameters(), offload="cpu", **low_bit)
        assert not isinstance(info.value, NotImplementedError), info.value
        assert any(entry.name == "allocate" for entry in info.traceback), info.value
        with pytest.raises(NotImplementedError, match=r"exp_avg_dtype='8bit'.*adam_step_blockwise.*offload_fraction=1.0"):
            DistributedFusedAdam(_model().parameters(), offload="cpu", offload_fraction=0.5, **low_bit)
    finally:
        config.configure(kernels=None)


def test_host_memory_reads_meminfo_capped_by_the_cgroup(tmp_path):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       1000 kB\nMemAvailable:    800 kB\n")
    v2max, v2cur = tmp_path / "memory.max", tmp_path / "memory.current"
    v1max, v1cur = tmp_path / "limit", tmp_path / "usage"
    files = ((str(v2max), str(v2cur)), (str(v1max), str(v1cur)))
    assert offload.host_memory_available(str(meminfo), files) == (800 * 1024, "MemAvailable")  # no cgroup files
    v2max.write_text("max\n")
    v2cur.write_text("5000\n")
    assert offload.host_memory_available(str(meminfo), files)[0] == 800 * 1024  # v2 without a limit
    v1max.write_text("400000\n")
    v1cur.write_text("100000\n")
    assert offload.host_memory_available(str(meminfo), files) == (300000, f"the cgroup limit {v1max} less its usage")
    v2max.write_text("100000\n")  # v2 first, where it has a limit
    assert offload.host_memory_available(str(meminfo), files) == (95000, f"the cgroup limit {v2max} less its usage")
    assert offload.host_memory_available(str(tmp_path / "none"), ()) == (None, "")
    assert offload.local_ranks({"LOCAL_WORLD_SIZE": "4"}) == 4 and offload.local_ranks({}) == 1
    assert offload.memory_verdict(10, 4, 40, "x") == "fits" and offload.memory_verdict(10, 4, None, "") == "fits"
    assert offload.memory_verdict(10, 4, 39, "x") == "needs 40 B (4 rank(s) x 10 B) > 39 B available (x)"


def _untouched(model, storages, before):
    assert [p.untyped_storage().data_ptr() for p in model.parameters()] == storages
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))


def test_too_little_host_memory_raises_at_construction_before_any_state_moves(monkeypatch):
    opt = DistributedFusedAdam(_model(torch.bfloat16).parameters(), offload="cpu")
    per_rank = opt._host.needed  # master, moments, the bf16 grad copy and param return buffer: 16 B an element
    assert per_rank == 16 * sum(b.shard_numel for b in opt._buckets)
    assert per_rank >= 16 * sum(p.numel() for p in _model().parameters())
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "3")
    monkeypatch.setattr(offload, "host_memory_available", lambda: (1000, "MemAvailable"))
    model = _model(torch.bfloat16)
    before = [p.detach().clone() for p in model.parameters()]
    storages = [p.untyped_storage().data_ptr() for p in model.parameters()]
    with pytest.raises(RuntimeError) as info:
        DistributedFusedAdam(model.parameters(), offload="cpu")
    text = str(info.value)
    assert text.startswith("DistributedFusedAdam(offload='cpu'): too little host memory")
    assert f"needs {per_rank} B per rank, {3 * per_rank} B for the 3 rank(s) on this host (LOCAL_WORLD_SIZE)" in text
    assert "1000 B are available (MemAvailable); pass a smaller offload_fraction" in text
    _untouched(model, storages, before)
    monkeypatch.setattr(offload, "host_memory_available", lambda: (3 * per_rank, "MemAvailable"))
    DistributedFusedAdam(model.parameters(), offload="cpu")  # exactly enough


def test_a_failed_pin_raises_at_construction_before_any_state_moves(monkeypatch):
    def fail(numel, dtype, pin):
        raise RuntimeError("CUDA error: out of memory\nmore lines")

    monkeypatch.setattr(host_state, "host_empty", fail)
    model = _model()
    before = [p.detach().clone() for p in model.parameters()]
    storages = [p.untyped_storage().data_ptr() for p in model.parameters()]
    with pytest.raises(RuntimeError, match=r"^DistributedFusedAdam\(offload='cpu'\): allocating \d+ B of host memory "
                                         r"failed: CUDA error: out of memory\. Page-locked memory is capped by the "
                                         r"container's locked-memory limit .* Nothing was allocated on the device"):
        DistributedFusedAdam(model.parameters(), offload="cpu")
    _untouched(model, storages, before)


def test_cpu_threads_default_to_the_cores_over_the_local_ranks_and_the_setting_overrides(monkeypatch):
    monkeypatch.setattr(offload, "host_cores", lambda: 16)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert DistributedFusedAdam(_model().parameters(), offload="cpu")._host.threads == 4
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "32")
    assert DistributedFusedAdam(_model().parameters(), offload="cpu")._host.threads == 1
    try:
        config.configure(offload_threads=3)
        opt = DistributedFusedAdam(_model().parameters(), offload="cpu")
        assert opt._host.threads == 3
        seen = []
        real = torch.set_num_threads
        monkeypatch.setattr(torch, "set_num_threads", lambda n: (seen.append(n), real(n)))
        before = torch.get_num_threads()
        _model_step(opt)
        assert seen[0] == 3 and torch.get_num_threads() == before  # set for the CPU step, restored after
    finally:
        config.configure(offload_threads=None)
    with pytest.raises(ValueError, match="SHARDAMP_OFFLOAD_THREADS"):
        config.from_environment({"SHARDAMP_OFFLOAD_THREADS": "many"})


def _model_step(opt, scale=1.0):
    params = [p for g in opt.param_groups for p in g["params"]]
    loss = sum((p.float() * (i + 1)).sum() for i, p in enumerate(params)) * scale
    loss.backward()
    opt.step()


def test_the_cpu_path_is_the_offloaded_one_not_a_no_op():
    """Separate host tensors; each grad shard copied to its host buffer as it lands in backward
    (before step); the step writes the host state and copies the params back; a skipped step
    leaves the host state untouched and copies nothing."""
    model = _model(torch.bfloat16)
    opt = DistributedFusedAdam(two_groups_seq(model), bucket_cap_mb=0.0001, offload="cpu", lr=0.1)
    shards = opt._host.by_bucket()
    assert len(opt._buckets) > 1 and all(s is not None for s in shards)
    for buf, hs in zip(opt._buffers, shards):
        assert buf.master is hs.master and buf.exp_avg is hs.exp_avg and buf.master.device.type == "cpu"
        assert hs.out is not None and hs.out.dtype == torch.bfloat16 and hs.grad.dtype == torch.bfloat16
        assert torch.equal(hs.master, buf.params[buf.shard].float())  # the master from the params
    params = [p for g in opt.param_groups for p in g["params"]]
    loss = sum((p.float() * (i + 1)).sum() for i, p in enumerate(params))
    loss.backward()
    for i, hs in enumerate(shards):  # landed and copied during backward, before any step
        assert hs.copied is not None and hs.grad.data_ptr() != opt._buffers[i].grad_shard.data_ptr()
        assert torch.equal(hs.grad, opt._buffers[i].grad_shard)
    opt.step()
    for buf, hs in zip(opt._buffers, shards):
        assert torch.equal(hs.out, buf.params[buf.shard])  # the params came back from the host buffer
        assert torch.equal(hs.out, hs.master.bfloat16()) and hs.exp_avg.abs().sum() > 0
    opt.zero_grad()
    assert all(hs.copied is None for hs in shards)
    state = [(hs.master.clone(), hs.exp_avg.clone(), hs.exp_avg_sq.clone(), hs.out.clone()) for hs in shards]
    model_before = [p.detach().clone() for p in params]
    _model_step(opt, scale=float("inf"))  # skipped
    assert opt.step_stats()["skipped_nonfinite"] == 1
    for hs, (m, a, b, o) in zip(shards, state):
        assert torch.equal(hs.master, m) and torch.equal(hs.exp_avg, a) and torch.equal(hs.exp_avg_sq, b)
        assert torch.equal(hs.out, o)
    assert all(torch.equal(p, b) for p, b in zip(params, model_before))


def two_groups_seq(model):
    ps = list(model.parameters())
    return [{"params": ps[:2], "lr": 0.1}, {"params": ps[2:], "lr": 0.05, "weight_decay": 0.1}]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_reused_grads_and_zero_fill_step_exactly_as_without_offload(dtype):
    """The host copy follows the shard past its landing: a second step without backward (the
    grads folded by the first step's coefficient), backward without zero_grad (added to), and
    zero_grad(set_to_none=False) (zeros): bitwise the default run."""
    import warnings

    runs = []
    for off in (None, "cpu"):
        model = _model(dtype)
        opt = DistributedFusedAdam(two_groups_seq(model), bucket_cap_mb=0.0001, offload=off, max_grad_norm=0.5)
        trace = []
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the no-zero_grad warning
            _model_step(opt)
            opt.step()  # again, on what the first step left
            trace.append([p.detach().clone() for p in model.parameters()])
            _model_step(opt)  # backward without zero_grad: added to the kept grads
            trace.append([p.detach().clone() for p in model.parameters()])
            opt.zero_grad(set_to_none=False)
            opt.step()
            trace.append([p.detach().clone() for p in model.parameters()])
        runs.append((trace, opt.state_dict()))
    for a, b in zip(runs[0][0], runs[1][0]):
        assert all(same(x, y) for x, y in zip(a, b))
    cc.assert_sd_equal(runs[0][1], runs[1][1])


@pytest.mark.parametrize("moments", ["fp32", "q8_q4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_process_without_a_clip_steps_through_the_host_state(dtype, moments, monkeypatch):
    """One process, no max_grad_norm, no clip, no scaler: without offload the step finishes the
    stats in its one native call (StatsPlan.step); offloaded, the stats are finished first and
    HostState.launch_step steps the host shards (blockwise moments: the native blockwise CPU
    kernel). Bitwise the same params, state and health, an inf step skipped by both."""
    planned = []
    plan_step = grad_stats.StatsPlan.step
    monkeypatch.setattr(grad_stats.StatsPlan, "step", lambda *a, **k: planned.append(1) or plan_step(*a, **k))
    formats = dict(exp_avg_dtype="8bit", exp_avg_sq_dtype="4bit") if moments == "q8_q4" else {}
    x = torch.randn(6, 7, generator=torch.Generator().manual_seed(1))
    runs = {}
    for off in (None, "cpu"):
        model = _model(dtype)
        opt = DistributedFusedAdam(two_groups_seq(model), bucket_cap_mb=0.0001, offload=off, **formats)
        planned.clear()
        trace = []
        for step in range(4):
            opt.zero_grad()
            scale = math.inf if step == 2 else 1.0
            (model(x.to(dtype)).float().pow(2).sum() * scale).backward()
            opt.step()
            trace.append([p.detach().clone() for p in model.parameters()])
        runs[off] = (trace, cl.quiet_sd(opt), opt.step_stats(), len(planned))
        if off is not None:
            shards = opt._host.by_bucket()
            assert len(shards) > 1 and all(hs is not None and hs.launch is not None for hs in shards)
            if formats:  # the host launches took the compiled blockwise step
                assert all(hs.launch.blockwise_natives is not None for hs in shards)
    (trace_a, sd_a, stats_a, planned_a), (trace_b, sd_b, stats_b, planned_b) = runs[None], runs["cpu"]
    assert planned_a == 4 and planned_b == 0  # the one-call step without offload only
    for a, b in zip(trace_a, trace_b):
        assert all(same(u, v) for u, v in zip(a, b))
    assert all(same(u, v) for u, v in zip(trace_a[2], trace_a[1]))  # the inf step skipped
    assert not any(same(u, v) for u, v in zip(trace_a[0], trace_a[-1]))  # and the others trained
    assert cl.sd_equal(sd_a, sd_b) == ""
    assert stats_a == stats_b and stats_b["skipped_nonfinite"] == 1


# ====================================================================== several ranks
@functools.lru_cache(maxsize=None)
def _groups():
    tmp = tempfile.mkdtemp(prefix="shardamp-offload-")
    w3 = run_distributed(co.run, 3, tmp, ["case_loops", "case_save"])
    w2 = run_distributed(co.run, 2, tmp, ["case_loops", "case_resume_from_3", "case_pipelined"])
    w1 = run_distributed(co.run, 1, tmp, ["case_resume_from_2"])
    return {3: w3, 2: w2, 1: w1}


@pytest.fixture(scope="module")
def groups():
    return _groups()


def check_offloaded_loop(config: str, loop: str, runs, where) -> None:
    """One config x loop of cases_offload.run_loop: the offloaded run bitwise the default one at
    every step (params, norms, scales), in its state dict, step_stats() and last_nonfinite(); the
    run did what it tests (the inf step skipped, a spike skipped where the loop has one,
    training); the state did live on the host (all buckets, or some under offload_fraction), and
    memory_stats() counts it there."""
    where = (*where, config, loop)
    a, b = runs[None], runs["cpu"]
    assert len(a["steps"]) == len(b["steps"]) == co.STEPS
    for step, (sa, sb) in enumerate(zip(a["steps"], b["steps"])):
        assert sorted(sa) == sorted(sb)
        for x, y in zip(sa["params"], sb["params"]):
            assert same(x, y), (*where, step)
        for key in sa:
            if key != "params":
                v, u = sa[key], sb[key]
                assert same(v, u) if isinstance(v, torch.Tensor) else v == u, (*where, step, key)
    assert cl.sd_equal(a["sd"], b["sd"]) == "", where  # also the blockwise formats' entries
    assert a["step_stats"] == b["step_stats"], where
    assert a["last_nonfinite"] == b["last_nonfinite"], where
    # the runs did what they test: an inf step skipped everywhere (and a spike where the loop has one)
    stats = b["step_stats"]
    assert stats["skipped_spike"] == (loop in co.SPIKE_LOOPS), where
    assert stats["skipped_nonfinite"] == 1, where
    if loop == "E":  # skipped in torch's path: ShardedGradScaler never calls step
        assert [s["skipped"] for s in b["steps"]] == [i == co.INF_STEP for i in range(co.STEPS)], where
    inf = b["steps"][co.INF_STEP]
    assert all(torch.equal(x, y) for x, y in zip(inf["params"], b["steps"][co.INF_STEP - 1]["params"])), where
    assert not any(torch.equal(x, y) for x, y in zip(b["steps"][0]["params"], b["steps"][-1]["params"])), where
    # the state did live on the host
    assert a["host_buckets"] == [] and b["host_separate"], where
    half = config == "fp32_half_offloaded"
    assert b["host_buckets"] == list(range(len(b["host_buckets"]))), where  # from the first landing on
    assert 0 < len(b["host_buckets"]) < b["buckets"] if half else len(b["host_buckets"]) == b["buckets"]
    mem_a, mem_b = a["memory"], b["memory"]
    assert mem_b["host_total"] == mem_b["host_master"] + mem_b["host_moments"] + mem_b["host_copies"] > 0
    assert mem_a["host_total"] == 0
    assert (mem_b["moments"] > 0) == half and mem_b["moments"] + mem_b["host_moments"] == mem_a["moments"]
    assert mem_b["grad_shards"] == mem_a["grad_shards"]


@pytest.mark.parametrize("world", [2, 3])
def test_offloaded_loops_are_bitwise_the_default_run(groups, world):
    """Loops A-G x the configs (cases_offload.CONFIGS / CONFIG_LOOPS) at worlds 2 and 3."""
    seen = set()
    for rank, value in enumerate(case_values(groups[world], "case_loops")):
        for (config, loop), runs in value.items():
            check_offloaded_loop(config, loop, runs, (world, rank))
            seen.add((config, loop))
    assert {loop for _, loop in seen} == set("ABCDEFG")
    assert {loop for config, loop in seen if config == "q8_q4"} >= {"C", "G"}
    assert {loop for config, loop in seen if config == "fp32_half_offloaded"} == set("ABCDEFG")


def test_checkpoints_saved_offloaded_load_without_and_with_offload_at_other_world_sizes(groups):
    saved = case_values(groups[3], "case_save")[0]["sd"]
    for world, source_sd in ((2, saved), (1, None)):
        case = "case_resume_from_3" if world == 2 else "case_resume_from_2"
        for value in case_values(groups[world], case):
            for how in ("sd", "dcp"):
                plain, off = value[(how, None)], value[(how, "cpu")]
                cc.assert_sd_equal(plain["loaded"], off["loaded"])
                if source_sd is not None:
                    cc.assert_sd_equal(plain["loaded"], source_sd)  # bitwise what world 3 saved
                cc.assert_sd_equal(plain["final_sd"], off["final_sd"])
                assert all(same(x, y) for x, y in zip(plain["final"], off["final"]))
    # world 1 loaded what world 2 saved offloaded after training on: its state dict, bitwise
    saved_w2 = case_values(groups[2], "case_resume_from_3")[0][("dcp", "cpu")]["final_sd"]
    for value in case_values(groups[1], "case_resume_from_2"):
        cc.assert_sd_equal(value[("sd", None)]["loaded"], saved_w2)


def test_grads_copied_to_the_host_during_backward_on_every_rank(groups):
    for value in case_values(groups[2], "case_pipelined"):
        assert value["copied_in_backward"] == [True, True, True]
        assert value["pinned"] and not any(value["pinned"])  # CPU ranks: separate host tensors, not pinned
