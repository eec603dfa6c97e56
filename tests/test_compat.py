"""Every torch internal shardamp relies on (optim/_compat.py) exists and behaves on this torch."""
from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

from dist_helper import run_distributed
from shardamp.optim import _compat


def _collectives(rank: int, world: int):
    out = torch.zeros(2)
    _compat.reduce_scatter(out, torch.arange(2.0 * world) + rank, None, async_op=True).wait()
    full = torch.zeros(2 * world)
    full[2 * rank: 2 * rank + 2] = rank + 1
    _compat.all_gather(full, full[2 * rank: 2 * rank + 2], None, async_op=False)
    t = torch.tensor([float(rank)])
    _compat.all_reduce(t, dist.ReduceOp.MAX, None)
    b = torch.tensor([float(rank + 5)])
    _compat.broadcast_from_group_rank0(b, None)
    s = torch.tensor([float(rank + 1)])
    _compat.all_reduce_async(s, dist.ReduceOp.SUM, None).wait()
    pieces = [torch.zeros(1) for _ in range(world)] if rank == 0 else None
    _compat.gather_to_group_rank0(torch.tensor([float(10 + rank)]), pieces, None)
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (1, world), mesh_dim_names=("replicate", "shard"))
    flat = _compat.flat_mesh_group(mesh)
    mesh_checks = (_compat.is_device_mesh(mesh), not _compat.is_device_mesh(object()),
                   dist.get_world_size(flat), dist.get_rank(flat))
    # what collective_order.py reads: a group's name (the same on every rank), whether it is
    # alive, its timeout, the default store (each rank sees the others' keys)
    import datetime

    world_pg = dist.group.WORLD
    side = dist.new_group(list(range(world)), timeout=datetime.timedelta(seconds=7), use_local_synchronization=True)
    store = _compat.default_store()
    store.set(f"compat-{rank}", str(rank))
    store.wait([f"compat-{r}" for r in range(world)])
    group_checks = (_compat.group_name(world_pg), _compat.group_alive(side), _compat.group_timeout(side),
                    [store.get(f"compat-{r}").decode() for r in range(world)])
    _compat.all_reduce(t, dist.ReduceOp.MAX, side, async_op=True).wait()
    # what collective_watchdog.py calls: the WORLD object, a group's timeout per device type (a
    # gloo group serves CUDA tensors too: the same), ProcessGroup.abort() of one group alone
    # (returns at once on gloo; WORLD stays usable)
    doomed = dist.new_group(list(range(world)), use_local_synchronization=True)
    t0 = time.monotonic()
    _compat.abort_group(doomed)
    aborted_in = time.monotonic() - t0
    after = torch.ones(1)
    _compat.all_reduce(after, dist.ReduceOp.SUM, None)
    watchdog_checks = (_compat.world_group() is dist.group.WORLD, _compat.group_timeout(side, "cuda"), aborted_in,
                       after.item())
    return out, full, t, b, s, pieces, mesh_checks + (group_checks, watchdog_checks)


def test_collectives_through_compat() -> None:
    world = 2
    results = run_distributed(_collectives, world)
    assert len({r[6][4][0] for r in results}) == 1  # the group's name is the same on every rank
    for rank, (out, full, t, b, s, pieces, mesh_checks) in enumerate(results):
        assert s.item() == world * (world + 1) / 2
        assert pieces == ([torch.tensor([10.0 + r]) for r in range(world)] if rank == 0 else None)
        assert mesh_checks[:4] == (True, True, world, rank)
        name, alive, timeout, seen = mesh_checks[4]
        assert isinstance(name, str) and alive and seen == [str(r) for r in range(world)]
        assert timeout is not None and timeout.total_seconds() == 7
        is_world, cuda_timeout, aborted_in, after = mesh_checks[5]
        assert is_world and cuda_timeout == timeout and aborted_in < 5 and after == world
        expected = world * (torch.arange(2.0 * world) + (world - 1) / 2)
        torch.testing.assert_close(out, expected[2 * rank: 2 * rank + 2])
        assert full.tolist() == [1.0, 1.0, 2.0, 2.0]
        assert t.item() == world - 1
        assert b.item() == 5.0


def test_grad_scaler_internals() -> None:
    scaler = torch.amp.GradScaler("cpu")
    opt = torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=0.1)
    state = _compat.scaler_optimizer_state(scaler, opt)
    assert state["stage"] is _compat.OptState.READY and state["found_inf_per_device"] == {}
    scaler.scale(torch.ones(()))
    assert _compat.scaler_scale(scaler).item() == 2.0**16
    scale, tracker = torch.full((), 8.0), torch.zeros((), dtype=torch.int32)
    _compat.amp_update_scale_(scale, tracker, torch.ones(()), 2.0, 0.5, 10)
    assert scale.item() == 4.0
    assert _compat.all_scaler_optimizer_states(scaler) == [_compat.scaler_optimizer_state(scaler, opt)]
    scale, tracker = _compat.scale_and_growth_tracker(scaler, "test")
    assert scale.item() == 2.0**16 and tracker.item() == 0
    _compat.refresh_scaler_states(scaler)
    assert _compat.all_scaler_optimizer_states(scaler) == []
    assert _compat.scaler_optimizer_state(scaler, opt)["stage"] is _compat.OptState.READY


def test_backward_callback_runs_after_backward() -> None:
    seen = []
    p = torch.nn.Parameter(torch.ones(3))
    p.register_post_accumulate_grad_hook(lambda _: _compat.queue_backward_callback(lambda: seen.append("end")))
    (p * 2).sum().backward()
    assert seen == ["end"]


def test_graph_task_reachability() -> None:
    """What sync/backward_order.py asks at a backward's first grad: the graph task's id, and
    whether it runs a param's grad accumulator (reachable; not a frozen or unused param's; with
    ``backward(inputs=)`` only the inputs')."""
    used, unused, frozen = (torch.nn.Parameter(torch.ones(3)) for _ in range(3))
    frozen.requires_grad_(False)
    held = _compat.grad_accumulator(used)  # held: the one the next graph leads to
    assert "AccumulateGrad" in held.name()
    seen = []

    def hook(_):
        seen.append((_compat.graph_task_id(), _compat.reached_in_backward(held),
                     _compat.reached_in_backward(_compat.grad_accumulator(unused))))

    used.register_post_accumulate_grad_hook(hook)
    (used * frozen).sum().backward()
    (used * unused).sum().backward(inputs=[used])
    (used * unused).sum().backward()
    assert [s[1:] for s in seen] == [(True, False), (True, False), (True, True)], seen
    ids = [s[0] for s in seen]
    assert all(i >= 0 for i in ids) and len(set(ids)) == 3, ids  # one graph task per backward()
    assert _compat.graph_task_id() == -1 and not _compat.in_backward()


def test_dense_layout_check() -> None:
    assert _compat.is_dense_non_overlapping(torch.zeros(2, 3, 4, 5).to(memory_format=torch.channels_last))
    assert _compat.is_dense_non_overlapping(torch.zeros(2, 3, 4, 5, 6).to(memory_format=torch.channels_last_3d))
    assert _compat.is_dense_non_overlapping(torch.zeros(4, 5).t())
    assert not _compat.is_dense_non_overlapping(torch.zeros(4, 6)[:, ::2])
    assert not _compat.is_dense_non_overlapping(torch.zeros(4, 1).expand(4, 3))


def test_storage_alias_shares_bytes_but_not_the_storage_object() -> None:
    flat = torch.arange(12.0)
    alias = _compat.storage_alias(flat, 4, 6, (2, 3), (1, 2))  # a transposed 3x2 block
    assert alias.untyped_storage().data_ptr() == alias.data_ptr() == flat[4:].data_ptr()
    assert alias.untyped_storage().nbytes() == 6 * 4  # only its own bytes: safetensors sees it alone
    torch.testing.assert_close(alias, flat[4:10].view(3, 2).t())
    alias.add_(100.0)  # writes reach the buffer ...
    assert flat[4:10].tolist() == [104.0, 105.0, 106.0, 107.0, 108.0, 109.0] and flat[3] == 3.0
    flat[5] = -1.0  # ... and the other way round
    assert alias[1, 0] == -1.0
    del flat
    assert alias.sum().item() > 0  # the alias keeps the buffer's memory alive
    assert _compat.storage_alias(torch.zeros(4), 4, 0, (0,), (1,)).numel() == 0


def test_foreach_copy_and_add_across_layouts_and_dtypes() -> None:
    """The multi-tensor ops the grad hooks land staged grads with: strided (channels_last) views
    of a flat buffer, mixed sizes, a dtype conversion."""
    flat = torch.zeros(200)
    a = flat[:24].as_strided((2, 3, 2, 2), torch.zeros(2, 3, 2, 2).to(memory_format=torch.channels_last).stride())
    b = flat[32:37]
    ga = torch.randn(2, 3, 2, 2).to(memory_format=torch.channels_last)
    gb = torch.randn(5, dtype=torch.float64)
    _compat.foreach_copy_([a, b], [ga, gb])
    torch.testing.assert_close(a, ga)
    torch.testing.assert_close(b, gb.float())
    _compat.foreach_add_([a, b], [ga, gb.float()])
    torch.testing.assert_close(a, 2 * ga)
    torch.testing.assert_close(b, 2 * gb.float())
    assert flat[24:32].abs().sum() == 0 and flat[37:].abs().sum() == 0


def test_in_backward() -> None:
    seen = []
    p = torch.nn.Parameter(torch.ones(2))
    p.register_post_accumulate_grad_hook(lambda _: seen.append(_compat.in_backward()))
    assert not _compat.in_backward()
    (p * 2).sum().backward()
    assert seen == [True] and not _compat.in_backward()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_cuda_event_handle() -> None:
    event = torch.cuda.Event()
    assert _compat.cuda_event_handle(event) == 0
    event.record()
    assert _compat.cuda_event_handle(event) != 0


# ---------------------------------------------------------------- grads visible to torch's tools (torch_tools.py)
def test_grad_property_class_over_autograds_field() -> None:
    """A Parameter switched to ``grad_property_class``: Python reads go through ``fget``, writes
    and deletes to autograd's field, autograd accumulates into that field as before, and the
    param switches back. ``raw_grad`` reads the field past the property."""
    reads = []

    def fget(p):
        reads.append(1)
        g = _compat.raw_grad(p)
        return g if g is not None else "shown"

    p = torch.nn.Parameter(torch.ones(3))
    cls = _compat.grad_property_class(torch.nn.Parameter, fget)
    assert cls is _compat.grad_property_class(torch.nn.Parameter, fget)  # cached
    assert cls.__name__ == "Parameter" and cls._shardamp_grad_base is torch.nn.Parameter
    assert _compat.switch_class(p, cls) and type(p) is cls and isinstance(p, torch.nn.Parameter)
    assert p.grad == "shown" and _compat.raw_grad(p) is None and reads == [1]
    (p * 2).sum().backward()
    (p * 3).sum().backward()  # accumulates into the field
    assert _compat.raw_grad(p).tolist() == [5.0, 5.0, 5.0] and p.grad.tolist() == [5.0, 5.0, 5.0]
    p.grad = None
    assert _compat.raw_grad(p) is None
    _compat.set_raw_grad(p, torch.zeros(3))
    del p.grad
    assert _compat.raw_grad(p) is None
    m = torch.nn.Linear(2, 2)
    _compat.switch_class(m.weight, _compat.grad_property_class(type(m.weight), fget))
    copied = __import__("copy").deepcopy(m)  # a copy nothing manages: the param's own class
    assert type(copied.weight) is torch.nn.Parameter and type(m.weight) is not torch.nn.Parameter
    assert torch.equal(copied.weight, m.weight) and copied.weight.data_ptr() != m.weight.data_ptr()
    assert _compat.switch_class(p, torch.nn.Parameter) and type(p) is torch.nn.Parameter
    assert p.grad is None


def test_wrapper_subclass_meets_torchs_grad_tools_in_dispatch() -> None:
    """What torch's tools do with a grad reaches ``__torch_dispatch__`` as these ATen ops:
    ``.data`` and ``.detach()`` (detach), ``Tensor.norm`` / ``torch.norm`` /
    ``torch.linalg.vector_norm`` (linalg_vector_norm), ``get_total_norm(foreach=True)``
    (_foreach_norm), ``GradScaler.unscale_`` over ``param.grad``
    (_amp_foreach_non_finite_check_and_unscale_); ``get_total_norm`` and GradScaler group it by
    device and dtype."""
    seen = []

    class Fake(torch.Tensor):
        __torch_function__ = _compat.disabled_torch_function

        @staticmethod
        def __new__(cls, like):
            return _compat.make_wrapper_subclass(cls, like)

        @classmethod
        def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
            seen.append(func)
            if func is _compat.aten_op("detach.default"):
                return Fake(args[0])
            if func is _compat.aten_op("linalg_vector_norm.default"):
                return torch.tensor(3.0)
            if func is _compat.aten_op("_foreach_norm.Scalar"):
                return [torch.tensor(4.0) for _ in args[0]]
            if func is _compat.aten_op("_amp_foreach_non_finite_check_and_unscale_.default"):
                args[1].fill_(1.0)
                return None
            raise RuntimeError(f"unexpected {func}")

    like = torch.zeros(2, 3, 4, 5).to(memory_format=torch.channels_last)
    g = Fake(like)
    assert (g.shape, g.stride(), g.dtype) == (like.shape, like.stride(), like.dtype)
    assert g.data.norm(2).item() == 3.0 and torch.norm(g).item() == 3.0
    assert torch.linalg.vector_norm(g, 1.0).item() == 3.0
    assert torch.nn.utils.get_total_norm([g, g]).item() == pytest.approx(18.0 ** 0.5)
    assert torch.nn.utils.get_total_norm([g], foreach=True).item() == 4.0
    p = torch.nn.Parameter(torch.zeros(2))
    _compat.switch_class(p, _compat.grad_property_class(torch.nn.Parameter, lambda _p: Fake(torch.zeros(2))))
    scaler = torch.amp.GradScaler("cpu")
    opt = torch.optim.SGD([p], lr=0.1)
    scaler.scale(torch.ones(()))
    scaler.unscale_(opt)
    found = _compat.scaler_optimizer_state(scaler, opt)["found_inf_per_device"]
    assert [float(v) for v in found.values()] == [1.0]
    assert _compat.aten_op("_amp_foreach_non_finite_check_and_unscale_.default") in seen
    assert [float(n) for n in _compat.foreach_norm([torch.ones(4, dtype=torch.bfloat16)], 2.0, torch.float32)] == [2.0]


def test_clip_grad_norm_calls_its_module_globals() -> None:
    """torch's ``clip_grad_norm_`` looks ``_get_total_norm`` and ``_clip_grads_with_norm_`` up in
    its module at each call (what torch_tools.py wraps), and every name torch_tools wraps exists."""
    from torch.nn.utils import clip_grad

    calls = []
    places = _compat.torch_clip_functions()
    assert sorted(places) == ["clip_grad_value_", "clip_grads_with_norm_", "get_total_norm"]
    for name, pairs in places.items():
        assert all(callable(getattr(module, attr)) for module, attr in pairs)
    norm_fn, clip_fn = clip_grad._get_total_norm, clip_grad._clip_grads_with_norm_

    def norm(*a, **k):
        calls.append("norm")
        return norm_fn(*a, **k)

    def clip(*a, **k):
        calls.append("clip")
        return clip_fn(*a, **k)

    bound = torch.nn.utils.clip_grad_norm_  # bound before the patch, as `from torch.nn.utils import ...`
    p = torch.nn.Parameter(torch.ones(4))
    p.grad = torch.full((4,), 3.0)
    clip_grad._get_total_norm, clip_grad._clip_grads_with_norm_ = norm, clip
    try:
        assert bound([p], 1.0).item() == 6.0
    finally:
        clip_grad._get_total_norm, clip_grad._clip_grads_with_norm_ = norm_fn, clip_fn
    assert calls == ["norm", "clip"]


def test_tensor_version_counts_in_place_ops():
    """The offloaded step's host copy of a grad shard is current while the shard's version is the
    one copied (shards/host_state.py): every in-place op bumps it, an out-of-place one does not."""
    t = torch.zeros(4)
    v = _compat.tensor_version(t)
    t.add_(1.0)
    t[1:].mul_(2.0)  # through a view too
    assert _compat.tensor_version(t) == v + 2
    t + 1.0
    t.clone().zero_()
    assert _compat.tensor_version(t) == v + 2


def test_optimizer_step_wrapper_internals() -> None:
    """torch's step wrapper pieces the lean wrapper reads: the global hook dicts, the wrapper
    factory, the profiler's state, and ``hooked`` keeping torch's own wrapper off."""

    class Plain(torch.optim.Optimizer):
        def step(self, closure=None):  # noqa: ANN001, ANN201
            return "stepped"

    observed = []

    class Native:  # the compiled module's answer
        @staticmethod
        def record_function_observed() -> bool:
            return bool(observed)

    assert _compat.hook_optimizer_step(Plain, "_observer")
    wrapped = Plain.step
    opt = Plain([torch.nn.Parameter(torch.zeros(1))], {})
    assert Plain.step is wrapped, "torch's __init__ wrapped the step again"
    labels = []
    real = torch.autograd.profiler.record_function

    def recording(name, *args):  # noqa: ANN001, ANN202
        labels.append(name)
        return real(name, *args)

    torch.autograd.profiler.record_function = recording
    try:  # no observer query held (no compiled module): torch's wrapper, always
        assert opt.step() == "stepped" and labels == ["Optimizer.step#Plain.step"]
    finally:
        torch.autograd.profiler.record_function = real
    opt._observer = Native.record_function_observed
    assert opt.step() == "stepped"
    calls = []
    handle = opt.register_step_post_hook(lambda o, a, k: calls.append(o))
    assert opt.step() == "stepped" and calls == [opt]
    handle.remove()
    # torch's wrapper (its record_function label) only where the query says something observes it
    labels.clear()
    torch.autograd.profiler.record_function = recording
    try:
        opt.step()
        assert labels == []
        observed.append(True)
        opt.step()
        assert labels == ["Optimizer.step#Plain.step"]
    finally:
        torch.autograd.profiler.record_function = real


def test_grad_disabled_restores_the_callers_mode() -> None:
    seen = []

    @_compat.grad_disabled
    def body(fail: bool = False) -> int:
        seen.append(torch.is_grad_enabled())
        with torch.enable_grad():  # a closure inside the step records a graph, as under torch.no_grad
            seen.append(torch.is_grad_enabled())
        if fail:
            raise KeyError("inside")
        return 7

    assert body() == 7 and seen == [False, True] and torch.is_grad_enabled()
    with torch.no_grad():
        assert body() == 7 and not torch.is_grad_enabled()
    with pytest.raises(KeyError, match="inside"):
        body(fail=True)
    assert torch.is_grad_enabled() and seen == [False, True, False, True, False, True]
    assert body.__name__ == "body"  # functools.wraps: the step's name and docstring stay its own


def test_the_step_runs_without_autograd_and_leaves_the_mode_as_it_was() -> None:
    from shardamp.optim import DistributedFusedAdam

    model = torch.nn.Linear(4, 3)
    opt = DistributedFusedAdam(model.parameters(), lr=0.1)
    modes = []
    hook = opt.register_step_pre_hook(lambda *a: modes.append(torch.is_grad_enabled()))
    model(torch.randn(2, 4)).sum().backward()

    def closure() -> torch.Tensor:
        modes.append(torch.is_grad_enabled())
        return torch.zeros(())

    inner = opt._deferred.record_step  # called inside the step's body

    def record_step(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        modes.append(torch.is_grad_enabled())
        return inner(*args, **kwargs)

    opt._deferred.record_step = record_step
    opt.step(closure)
    hook.remove()
    assert modes == [True, True, False] and torch.is_grad_enabled()
    assert all(not p.requires_grad or p.grad_fn is None for p in model.parameters())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_cuda_stream_and_event_shortcuts_match_torch() -> None:
    """The step's stream, event and capture queries without torch.cuda's Python frames give what
    torch.cuda's own give: the current stream as it changes, an event recorded there, and the
    capture state inside and outside a graph's capture."""
    device = torch.device("cuda", torch.cuda.current_device())
    for _ in range(2):  # the first call takes torch's route, the second the cache
        assert _compat.cuda_current_stream(device) == torch.cuda.current_stream(device)
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        assert _compat.cuda_current_stream(device) == side != torch.cuda.default_stream(device)
        assert _compat.cuda_current_stream(torch.device("cuda")) == side  # no index: the current device's
    assert _compat.cuda_current_stream(device) == torch.cuda.current_stream(device)
    event = torch.cuda.Event()
    x = torch.ones(1 << 20, device=device)
    with torch.cuda.stream(side):
        side.wait_stream(torch.cuda.current_stream(device))
        y = x * 2
        _compat.cuda_event_record(event, _compat.cuda_current_stream(device))
    event.synchronize()
    assert _compat.cuda_event_query(event) and event.query() and float(y[-1]) == 2.0
    assert not _compat.cuda_capturing()
    graph, seen = torch.cuda.CUDAGraph(), []
    static = torch.zeros(4, device=device)
    with torch.cuda.graph(graph):
        static.add_(1)
        seen.append(_compat.cuda_capturing())
    graph.replay()
    torch.cuda.synchronize()
    assert seen == [True] and not _compat.cuda_capturing() and static.tolist() == [1.0] * 4
