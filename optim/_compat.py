"""Every use of torch internals or version-dependent names lives here.

torch 2.13 renames ``reduce_scatter_tensor`` / ``all_gather_into_tensor`` to ``*_single`` (the
old names warn); torch 2.11 has only the old names. GradScaler's per-optimizer bookkeeping
(``_per_optimizer_states``, ``OptState``) and autograd's end-of-backward callback queue are
private. Grads visible to torch's tools (torch_tools.py) rest on autograd's C-level grad field
under a Python-level ``grad`` property, a wrapper tensor subclass's ``__torch_dispatch__``, and
the module globals torch's ``clip_grad_norm_`` calls. The optimizer's step wrapper reads
``torch.optim.Optimizer``'s own (its hook dicts, ``profile_hook_step``, the ``hooked`` mark).
tests/test_compat.py checks each of these
on the torch version it runs on.
"""
from __future__ import annotations

import functools
import importlib
import itertools
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = [
    "reduce_scatter",
    "all_gather",
    "all_reduce",
    "all_reduce_async",
    "gather_to_group_rank0",
    "broadcast_from_group_rank0",
    "is_device_mesh",
    "group_name",
    "group_alive",
    "group_timeout",
    "world_group",
    "abort_group",
    "default_store",
    "flat_mesh_group",
    "queue_backward_callback",
    "graph_task_id",
    "grad_accumulator",
    "reached_in_backward",
    "OptState",
    "scaler_optimizer_state",
    "amp_update_scale_",
    "is_dense_non_overlapping",
    "storage_alias",
    "foreach_copy_",
    "foreach_add_",
    "raw_grad",
    "set_raw_grad",
    "grad_property_class",
    "switch_class",
    "make_wrapper_subclass",
    "disabled_torch_function",
    "foreach_norm",
    "torch_clip_functions",
    "aten_op",
    "hook_optimizer_step",
    "grad_disabled",
    "cuda_current_stream",
    "cuda_capturing",
    "cuda_event_record",
    "cuda_event_query",
]

_reduce_scatter_fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather_fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def reduce_scatter(output: torch.Tensor, input: torch.Tensor, group: Any, async_op: bool):
    """SUM-reduce ``input`` (world * output.numel()) and keep this rank's slice in ``output``."""
    return _reduce_scatter_fn(output, input, op=dist.ReduceOp.SUM, group=group, async_op=async_op)


def all_gather(output: torch.Tensor, input: torch.Tensor, group: Any, async_op: bool):
    """Gather every rank's ``input`` into ``output`` (``input`` may alias its own slice)."""
    return _all_gather_fn(output, input, group=group, async_op=async_op)


def queue_backward_callback(callback: Callable[[], None]) -> None:
    """Run ``callback`` once the current backward pass has finished (as DDP does)."""
    torch.autograd.Variable._execution_engine.queue_callback(callback)


def in_backward() -> bool:
    """Whether this thread is running an autograd backward (a hook or callback of it)."""
    return torch._C._current_graph_task_id() != -1


# ``graph_task_id()``: the id of the autograd graph task this thread is running (one per
# ``backward()`` call; a reentrant backward nested in another has its own), -1 outside any
# backward. torch's own C function: no Python frame where a hot path asks (torch_tools.py).
graph_task_id: Callable[[], int] = torch._C._current_graph_task_id


def grad_accumulator(param: Tensor) -> Any:
    """The ``AccumulateGrad`` node of leaf ``param`` (requiring grad): the one its autograd graphs
    lead to while one is alive (held here, it stays that one), else a new one."""
    return torch.autograd.graph.get_gradient_edge(param).node


def reached_in_backward(node: Any) -> bool:
    """Inside a backward: whether the current graph task will run ``node`` (it is reachable from
    the roots, and with ``backward(inputs=)`` needed). True where autograd cannot tell (the
    caller then assumes the worst)."""
    try:
        return bool(torch._C._will_engine_execute_node(node))
    except RuntimeError:
        return True


def hook_optimizer_step(cls: type, observer_attr: str) -> bool:
    """Wrap ``cls.step`` as ``torch.optim.Optimizer`` wraps every optimizer's step (its step
    pre/post hooks, global and per instance, a ``record_function`` label for the profiler and the
    profiler's ``_optimizer_step_code`` entry point), but take torch's wrapper only while a pre hook
    is registered, the autograd profiler is on in this thread, or any RecordFunction callback is
    registered, global or for this thread (a profiler of all threads, an execution-trace
    observer, CUDA memory-history annotations: ``at::hasCallbacks()``, asked through the
    callable the optimizer holds as its attribute ``observer_attr``, its compiled module's query;
    where it holds none, always torch's wrapper); otherwise call the step and the
    entry point directly, then the post hooks (one registered during the step runs, as torch's
    wrapper reads them after the step). The label's enter and exit cost tens of microseconds of
    host time per step on a small model's iteration whether or not anything records it. Marks
    the wrapper ``hooked`` as torch does, so torch's ``_patch_step_function`` leaves it be.
    Returns False (nothing done) where this torch lacks the pieces: the caller keeps torch's own
    wrapper."""
    opt_mod = importlib.import_module("torch.optim.optimizer")
    profile_hook_step = getattr(torch.optim.Optimizer, "profile_hook_step", None)
    profiler_enabled = getattr(torch._C._autograd, "_profiler_enabled", None)
    if (not hasattr(opt_mod, "_global_optimizer_pre_hooks") or not hasattr(opt_mod, "_global_optimizer_post_hooks")
            or profile_hook_step is None or profiler_enabled is None):
        return False
    if getattr(cls.step, "hooked", None):
        return True
    func = cls.step
    observed_step = profile_hook_step(func)

    @functools.wraps(func)
    def step(self: Any, *args: Any, **kwargs: Any) -> Any:
        observed = getattr(self, observer_attr, None)  # None (also before __init__ set it): torch's wrapper
        # the hook dicts read where and when torch's own wrapper reads them
        if (opt_mod._global_optimizer_pre_hooks or self._optimizer_step_pre_hooks or profiler_enabled()
                or observed is None or observed()):
            return observed_step(self, *args, **kwargs)
        out = func(self, *args, **kwargs)
        self._optimizer_step_code()
        if self._optimizer_step_post_hooks or opt_mod._global_optimizer_post_hooks:
            for hook in itertools.chain(self._optimizer_step_post_hooks.values(),
                                        opt_mod._global_optimizer_post_hooks.values()):
                hook(self, (self, *args), kwargs)  # torch's wrapper hands its own args: self first
        return out

    step.hooked = True  # type: ignore[attr-defined]
    cls.step = step
    return True


def grad_disabled(func: Callable[..., Any]) -> Callable[..., Any]:
    """``func`` run with autograd off and the caller's mode restored after, as ``@torch.no_grad()``
    decorates it, without the context object that decorator builds at every call (nine Python
    calls: a host-bound step pays each)."""
    is_enabled, set_enabled = torch._C.is_grad_enabled, torch._C._set_grad_enabled

    @functools.wraps(func)
    def disabled(*args: Any, **kwargs: Any) -> Any:
        before = is_enabled()
        set_enabled(False)
        try:
            return func(*args, **kwargs)
        finally:
            set_enabled(before)

    return disabled


# torch.cuda's current-stream query builds a Stream through nine Python frames at every call
# (device index resolution, lazy init, Stream.__new__); a host-bound step asks on every step.
# The Stream objects hold ids only (no resource), so one per (stream id, device, type) serves
# every later ask; external streams come and go, so the cache is bounded.
_STREAMS: Dict[Tuple[int, int, int], Any] = {}
_STREAMS_MAX = 256
_cuda_stream_of = getattr(torch._C, "_cuda_getCurrentStream", None)
_cuda_device = getattr(torch._C, "_cuda_getDevice", None)


def cuda_current_stream(device: torch.device) -> Any:
    """``torch.cuda.current_stream(device)`` (the stream work on ``device`` is queued on now), one
    Python call deep once seen."""
    if not _STREAMS or _cuda_stream_of is None:  # first call: torch's route initializes CUDA
        stream = torch.cuda.current_stream(device)
        _STREAMS[(stream.stream_id, stream.device_index, stream.device_type)] = stream
        return stream
    key = _cuda_stream_of(device.index if device.index is not None else _cuda_device())
    stream = _STREAMS.get(key)
    if stream is None:
        if len(_STREAMS) >= _STREAMS_MAX:
            _STREAMS.clear()
        stream = _STREAMS[key] = torch.cuda.Stream(stream_id=key[0], device_index=key[1], device_type=key[2])
    return stream


def _capturing_py() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


# a CPU build of torch names these as placeholder types: only a CUDA build's are taken
_cuda_built = _cuda_stream_of is not None
_event_base = getattr(torch._C, "_CudaEventBase", None) if _cuda_built else None
#: ``torch.cuda.is_current_stream_capturing()`` called as the C function it wraps (no Python frame)
cuda_capturing: Callable[[], bool] = (getattr(torch._C, "_cuda_isCurrentStreamCapturing", None) if _cuda_built
                                      else None) or _capturing_py
#: ``event.record(stream)`` and ``event.query()`` of a ``torch.cuda.Event``, called as the C methods
#: torch's Python wrappers call (no Python frame)
cuda_event_record: Callable[[Any, Any], None] = getattr(_event_base, "record", None) or (lambda e, s: e.record(s))
cuda_event_query: Callable[[Any], bool] = getattr(_event_base, "query", None) or (lambda e: e.query())


def cuda_event_handle(event: Any) -> int:
    """The raw ``cudaEvent_t`` of a recorded ``torch.cuda.Event`` (0 if never recorded)."""
    return int(event.cuda_event)


def foreach_copy_(dst: List[Tensor], src: List[Tensor]) -> None:
    """``dst[i].copy_(src[i])`` for all i in as few launches as the multi-tensor kernels allow
    (pairs of equal dtype and strides take the fused route, others a per-tensor copy)."""
    torch._foreach_copy_(dst, src)


def foreach_add_(dst: List[Tensor], src: List[Tensor]) -> None:
    """``dst[i].add_(src[i])`` for all i, multi-tensor."""
    torch._foreach_add_(dst, src)


from torch.amp.grad_scaler import OptState  # noqa: E402  (private enum, re-exported on purpose)


def scaler_optimizer_state(scaler: Any, optimizer: Any) -> dict:
    """GradScaler's bookkeeping dict for ``optimizer``: {"stage": OptState, "found_inf_per_device": {...}}."""
    return scaler._per_optimizer_states[id(optimizer)]


def all_scaler_optimizer_states(scaler: Any) -> list:
    """GradScaler's bookkeeping dicts of every optimizer stepped since the last update()."""
    return list(scaler._per_optimizer_states.values())


def scale_and_growth_tracker(scaler: Any, funcname: str):
    """(scale, growth_tracker) tensors; torch's own AssertionError if scale() was never called."""
    return scaler._check_scale_growth_tracker(funcname)


def scaler_scale(scaler: Any) -> Optional[torch.Tensor]:
    """The scaler's scale tensor without a host sync (None before the first ``scale()``)."""
    return scaler._scale


def amp_update_scale_(scale, growth_tracker, found_inf, growth_factor, backoff_factor, growth_interval):
    """torch's fused scale update (the exact arithmetic of ``GradScaler.update``)."""
    return torch._amp_update_scale_(
        scale, growth_tracker, found_inf, growth_factor, backoff_factor, growth_interval
    )


def tensor_version(t: torch.Tensor) -> int:
    """The version counter autograd bumps at every in-place op on ``t`` (``Tensor._version``): the
    offloaded step tells a grad shard's host copy still current from it (shards/host_state.py)."""
    return t._version


def is_dense_non_overlapping(t: torch.Tensor) -> bool:
    """True when ``t`` covers exactly ``t.numel()`` consecutive storage elements (any dim order)."""
    if t.numel() <= 1:
        return True
    dims = sorted((s, n) for s, n in zip(t.stride(), t.shape) if n != 1)
    expected = 1
    for stride, size in dims:
        if stride != expected:
            return False
        expected *= size
    return True


def all_reduce(tensor: torch.Tensor, op: Any, group: Any, async_op: bool = False):
    """In-place all-reduce (synchronous on the host, asynchronous on CUDA streams); with
    ``async_op`` its handle (the CPU path waits on it with a bound: collective_order.py)."""
    return dist.all_reduce(tensor, op=op, group=group, async_op=async_op)


def all_reduce_async(tensor: torch.Tensor, op: Any, group: Any):
    """In-place all-reduce, returning its handle (the grad replicas, the per-call agreement)."""
    return dist.all_reduce(tensor, op=op, group=group, async_op=True)


def gather_to_group_rank0(tensor: torch.Tensor, pieces: Optional[List[torch.Tensor]], group: Any) -> None:
    """Gather every rank's ``tensor`` into ``pieces`` on the group's rank 0 (None elsewhere)."""
    dst = dist.get_global_rank(group, 0) if group is not None else 0
    dist.gather(tensor, gather_list=pieces, dst=dst, group=group)


def group_name(group: Any) -> str:
    """A process group's name, the same on every member (``ProcessGroup.group_name``)."""
    return str(group.group_name)


def group_alive(group: Any) -> bool:
    """``group`` is still registered (not destroyed with ``destroy_process_group``): private."""
    from torch.distributed import distributed_c10d

    return group in distributed_c10d._world.pg_map


def group_timeout(group: Any, device_type: str = "cpu") -> Optional[Any]:
    """The timeout a group's backend for ``device_type`` was built with (a ``timedelta``; the
    options are private), None where it cannot be read (then a new group gets torch's default)."""
    try:
        return group._get_backend(torch.device(device_type)).options._timeout
    except (AttributeError, RuntimeError):
        return None


def world_group() -> Any:
    """The default process group object (``group.WORLD``)."""
    return dist.group.WORLD


def abort_group(group: Any) -> None:
    """``ProcessGroup.abort()`` of ``group`` alone (None = WORLD's own communicators, not every
    group as ``_abort_process_group(None)`` would): ProcessGroupNCCL aborts its NCCL
    communicators (kernels in flight exit, its watchdog stops without killing the process, later
    collectives raise); gloo's returns at once without ending a wait already in flight."""
    (group if group is not None else dist.group.WORLD).abort()


def default_store() -> Optional[Any]:
    """The default process group's store (private accessor), None without one."""
    from torch.distributed import distributed_c10d

    try:
        return distributed_c10d._get_default_store()
    except (RuntimeError, ValueError):
        return None


def is_device_mesh(obj: Any) -> bool:
    """``obj`` is a ``torch.distributed.device_mesh.DeviceMesh``."""
    from torch.distributed.device_mesh import DeviceMesh

    return isinstance(obj, DeviceMesh)


def flat_mesh_group(mesh: Any) -> Any:
    """A process group over all ranks of ``mesh`` (a sub-mesh of WORLD): ``DeviceMesh._flatten``
    is private; it creates (once, cached by the mesh) the group spanning every mesh dim."""
    return mesh._flatten().get_group()


def broadcast_from_group_rank0(tensor: torch.Tensor, group: Any) -> None:
    """Broadcast ``tensor`` from the group's rank 0 (converted to its global rank)."""
    src = dist.get_global_rank(group, 0) if group is not None else 0
    dist.broadcast(tensor, src=src, group=group)


def refresh_scaler_states(scaler: Any) -> None:
    """What ``GradScaler.update`` does last: forget every optimizer's stage and found-infs."""
    from collections import defaultdict

    from torch.amp.grad_scaler import _refresh_per_optimizer_state

    scaler._per_optimizer_states = defaultdict(_refresh_per_optimizer_state)


def storage_alias(buffer: torch.Tensor, offset: int, numel: int, shape, stride) -> torch.Tensor:
    """A tensor of ``shape``/``stride`` over elements ``[offset, offset + numel)`` of ``buffer``'s
    storage, with a storage OBJECT of its own that aliases those bytes and keeps ``buffer``'s
    storage alive. Slicing an ``UntypedStorage`` returns such an alias (not a copy); that is
    not documented, so tests/test_compat.py checks writes go both ways."""
    esize = buffer.element_size()
    sub = buffer.untyped_storage()[offset * esize:(offset + numel) * esize]
    return torch.empty(0, dtype=buffer.dtype, device=buffer.device).set_(sub, 0, tuple(shape), tuple(stride))


# ---------------------------------------------------------------- grads visible to torch's tools
# (torch_tools.py: why a param's Python-level ``.grad`` is overridden and its grad is a tensor subclass)
_TENSOR_GRAD = torch._C.TensorBase.grad  # the C-level getset over autograd's own grad field


# ``raw_grad(t)``: ``t.grad`` as autograd holds it (the C field), past any Python-level ``grad``
# property; ``set_raw_grad(t, value)``: ``t.grad = value`` on that field (torch's checks of shape,
# dtype and device apply). The descriptor's own methods: read per param by torch's clip, no frame.
raw_grad: Callable[[Tensor], Optional[Tensor]] = _TENSOR_GRAD.__get__
set_raw_grad: Callable[[Tensor, Optional[Tensor]], None] = _TENSOR_GRAD.__set__


_grad_classes: dict = {}


def grad_property_class(base: type, fget: Callable[[Tensor], Optional[Tensor]],
                        fset: Optional[Callable[[Tensor, Optional[Tensor]], None]] = None) -> type:
    """A subclass of the Parameter class ``base`` whose Python-level ``.grad`` reads ``fget(p)``
    and writes ``fset(p, value)`` (default: autograd's field; deletes always go there). Autograd
    (C++) keeps reading and accumulating into the C field, so backward and
    ``register_post_accumulate_grad_hook`` are unchanged. Cached per ``(base, fget, fset)``; the
    subclass keeps ``base``'s name, and adds no slots (so an instance of ``base`` can be switched
    to it and back by assigning ``__class__``); a ``copy.deepcopy`` of an instance is a ``base``."""
    key = (base, fget, fset)
    cls = _grad_classes.get(key)
    if cls is None:
        def _set(self: Tensor, value: Optional[Tensor]) -> None:
            if fset is None:
                _TENSOR_GRAD.__set__(self, value)
            else:
                fset(self, value)

        def _del(self: Tensor) -> None:
            _TENSOR_GRAD.__delete__(self)

        def _deepcopy(self: Tensor, memo: dict) -> Tensor:
            # torch's Parameter.__deepcopy__ builds type(self): the copy, which nothing manages,
            # takes the param's own class
            done = id(self) in memo
            copy = base.__deepcopy__(self, memo)
            if not done and type(copy) is cls:
                copy.__class__ = base
            return copy

        cls = type(base.__name__, (base,), {
            # fget itself (no wrapper): torch's clip and GradScaler read it once per param a step
            "grad": property(fget, _set, _del, _TENSOR_GRAD.__doc__),
            "__deepcopy__": _deepcopy,
            "__module__": __name__,
            "__qualname__": base.__qualname__,
            "_shardamp_grad_base": base,
        })
        _grad_classes[key] = cls
    return cls


def switch_class(t: Tensor, cls: type) -> bool:
    """Assign ``t.__class__ = cls``; False (``t`` unchanged) where Python refuses (another layout)."""
    try:
        t.__class__ = cls
    except TypeError:
        return False
    return True


def make_wrapper_subclass(cls: type, like: Tensor) -> Tensor:
    """An instance of the tensor subclass ``cls`` with ``like``'s shape, strides, dtype and device
    and no storage of its own: every op on it goes to ``cls.__torch_dispatch__``."""
    return torch.Tensor._make_wrapper_subclass(
        cls, like.shape, strides=like.stride(), dtype=like.dtype, device=like.device, requires_grad=False)


disabled_torch_function = torch._C._disabled_torch_function_impl


def foreach_norm(tensors: List[Tensor], ord: float, dtype: Optional[torch.dtype] = None) -> List[Tensor]:
    """``[torch.linalg.vector_norm(t, ord, dtype=dtype) for t in tensors]`` in as few launches as
    the multi-tensor kernels allow."""
    return list(torch._foreach_norm(tensors, ord, dtype=dtype))


# torch's clipping functions as shardamp wraps them (torch_tools.py): (module, attribute) pairs per
# function. ``clip_grad_norm_`` itself is not wrapped: it looks ``_get_total_norm`` and
# ``_clip_grads_with_norm_`` up in its module's globals at each call, so it goes through the
# wrapped ones, also where a caller bound it (``from torch.nn.utils import clip_grad_norm_``) first.
def torch_clip_functions() -> dict:
    import torch.nn.utils as utils
    from torch.nn.utils import clip_grad

    return {
        "get_total_norm": [(clip_grad, "_get_total_norm"), (utils, "get_total_norm")],
        "clip_grads_with_norm_": [(clip_grad, "_clip_grads_with_norm_"), (utils, "clip_grads_with_norm_")],
        "clip_grad_value_": [(clip_grad, "clip_grad_value_"), (utils, "clip_grad_value_")],
    }


def aten_op(name: str) -> Any:
    """The ATen op overload ``name`` ("packet.overload") as ``__torch_dispatch__`` receives it."""
    packet, overload = name.split(".")
    return getattr(getattr(torch.ops.aten, packet), overload)
