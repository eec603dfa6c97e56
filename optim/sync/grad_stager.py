"""Where a param's grad waits between its hook and its bucket's copy: the staging lists, the
per-bucket counts, and the backward hook that fills them.

Two implementations with the same methods:

* the native ``GradStager`` (csrc/grad_stager.cpp), used wherever the fused kernels are built:
  its hook is a C++ post hook on each param's grad accumulator, as DDP's reducer has. It stages
  a grad without the GIL and calls ``callback(event, arg)`` only for the events below, so a
  backward calls Python a few times per bucket instead of once per param (a Python hook per
  param costs ~10 us of host time each on a GPU host, where the whole AccumulateGrad costs ~2);
* :class:`PyStager`, the reference and the fallback (pure PyTorch kernels), hooked with
  ``register_post_accumulate_grad_hook``; its hook calls ``on_param`` for every grad and the
  caller stages it.

The native hook holds each param's grad accumulator (a param holds its own only weakly; the
hook lives on it), as DDP's reducer does, so the accumulator keeps the stream current when the
optimizer was built. A backward on another stream makes torch warn ("The AccumulateGrad node's
stream does not match ...") and sync the two streams; a CUDA-graph capture on its own stream
would be invalidated by that sync. So ``capturable=True`` optimizers take the Python hooks, whose
accumulators are made by each forward on its own stream (under capture: the capture stream);
so does ``SHARDAMP_PYTHON_GRAD_HOOKS=1``.

Events (``callback(event, arg)``):

* ``SLOW`` (arg: param index): Python decides: the first grad of a backward (until
  ``set_armed(True)``), a grad that is not strided (sparse), a param staged twice before its
  bucket was copied. The grad is still in ``param.grad``; Python calls ``stage(index)``.
* ``FLUSH`` (arg: bucket): the bucket's staged bytes reached its flush size: copy it (``land``).
* ``COMPLETE`` (arg: bucket): every param of the bucket produced its grad in this backward.
The first grad of a backward the stager was pre-armed for (``prearm(flags)``, from a standing
plan set once with ``set_standing``, and the backward's end set with ``set_quiet_begin(end)``)
sends no event: the hook stages it and queues ``end`` on the backward's graph task (it runs when
the backward finishes, its error raised from ``backward()``); ``take_quiet_begin()`` says, once,
that such a backward began.

``stage(i)`` takes ``params[i].grad`` (leaving None), appends it to its bucket, marks param ``i``
touched (``touched()``: bytes, one 0/1 per param, until ``clear_touched()``) and returns the
event it causes (``NONE``, ``FLUSH`` or ``COMPLETE``). ``take(b)`` hands over a bucket's staged
``(indices, grads)``; ``land(b, full, zero_rest=False)`` copies them into their slots of the flat
buffer ``full`` (``kernels.land_grads``; ``zero_rest``: the rest of ``full`` zeroed in the same
pass) and returns their indices. The native ``land`` frees landed CUDA grads on
a thread of its own (a free costs the autograd thread ~2 us of host time each, where torch pays
them in ``zero_grad``), one landing's grads at a time (while one is being freed the next is freed
inline: backward memory grows by one flush at most); grads Python has seen (staged by
``stage()``) are freed inline too. ``drain()`` waits until they are freed (``GradSync.zero``
calls it, so memory is where torch's is by then).
"""
from __future__ import annotations

import atexit
import weakref
from typing import Any, Callable, List, Optional, Sequence, Tuple

from torch import Tensor

from .. import _compat, config, kernels

NONE, SLOW, FLUSH, COMPLETE = 0, 1, 2, 3


class PyStager:
    """The reference staging (see the module docstring); ``attach`` registers Python hooks that
    call ``on_param(index)`` (given here or to ``attach``) for every param whose grad was
    accumulated."""

    def __init__(self, params: Sequence[Tensor], bucket_of: Sequence[int], offset: Sequence[int],
                 nbytes: Sequence[int], expected: Sequence[int], flush_bytes: Sequence[int],
                 on_param: Optional[Callable[[int], None]] = None) -> None:
        self.on_param = on_param
        self.params = list(params)
        self.bucket_of = list(bucket_of)
        self.offset = list(offset)
        self.nbytes = list(nbytes)
        self.expected = list(expected)
        self.flush_bytes = list(flush_bytes)
        self.staged = [False] * len(self.params)
        self.touched_flags = bytearray(len(self.params))
        self.pending: List[List[Tuple[int, Tensor]]] = [[] for _ in self.expected]
        self.bytes = [0] * len(self.expected)
        self.counts = [0] * len(self.expected)
        self.handles: list = []

    def attach(self, on_param: Optional[Callable[[int], None]] = None) -> None:
        on_param = on_param or self.on_param

        def make(index: int):
            return lambda _param: on_param(index)

        self.handles = [p.register_post_accumulate_grad_hook(make(i))
                        for i, p in enumerate(self.params) if p.requires_grad]

    def remove(self, erase: bool = True) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []

    def hooks(self) -> int:
        return len(self.handles)

    def stage(self, i: int) -> int:
        p = self.params[i]
        grad = p.grad
        if grad is None or self.staged[i]:
            raise RuntimeError(f"PyStager.stage: param {i} has no grad or is staged already")
        b = self.bucket_of[i]
        p.grad = None
        self.pending[b].append((i, grad))
        self.staged[i] = True
        self.touched_flags[i] = 1
        self.bytes[b] += self.nbytes[i]
        self.counts[b] += 1
        if self.counts[b] >= self.expected[b]:
            return COMPLETE
        return FLUSH if self.bytes[b] >= self.flush_bytes[b] else NONE

    def take(self, b: int) -> Tuple[List[int], List[Tensor]]:
        staged, self.pending[b], self.bytes[b] = self.pending[b], [], 0
        for i, _ in staged:
            self.staged[i] = False
        return [i for i, _ in staged], [g for _, g in staged]

    def land(self, b: int, full: Tensor, zero_rest: bool = False) -> List[int]:
        indices, grads = self.take(b)
        kernels.land_grads(full, grads, [self.params[i] for i in indices], [self.offset[i] for i in indices],
                           accumulate=False, zero_rest=zero_rest)
        return indices

    def touched(self) -> bytes:
        return bytes(self.touched_flags)

    def clear_touched(self) -> None:
        self.touched_flags = bytearray(len(self.params))

    def is_staged(self, i: int) -> bool:
        return self.staged[i]

    def staged_count(self, b: int) -> int:
        return len(self.pending[b])

    def staged_bytes(self, b: int) -> int:
        return self.bytes[b]

    def fired(self, b: int) -> int:
        return self.counts[b]

    def reset_fired(self) -> None:
        self.counts = [0] * len(self.expected)

    def clear(self) -> None:
        self.pending = [[] for _ in self.expected]
        self.staged = [False] * len(self.params)
        self.bytes = [0] * len(self.expected)
        self.counts = [0] * len(self.expected)

    def set_armed(self, armed: bool) -> None:
        pass  # every grad goes through on_param

    def drain(self) -> None:
        pass  # landed grads are freed in land()

    def disown(self, i: int) -> None:
        pass  # the Python hook checks the param's owner itself


def make_stager(native, params: Sequence[Tensor], bucket_of: Sequence[int], offset: Sequence[int],
                nbytes: Sequence[int], expected: Sequence[int], flush_bytes: Sequence[int],
                on_event: Callable[[int, int], None], on_param: Callable[[int], None]):
    """The native stager where ``native`` (the kernels' extension, or None) has one, calling
    ``on_event``; else a :class:`PyStager` whose Python hooks call ``on_param``. Not hooked yet:
    its ``attach()`` puts the hooks on the params."""
    args = (list(params), list(bucket_of), list(offset), list(nbytes), list(expected), list(flush_bytes))
    if native is not None and hasattr(native, "GradStager") and not _python_hooks_forced():
        _drain_at_exit(native)
        return native.GradStager(*args, on_event)
    return PyStager(*args, on_param)


def for_grad_sync(sync: Any, native: Any):
    """The stager of a ``GradSync`` (grad_sync.py): its Python hook calls
    ``sync.on_grad(entry)``, the native one ``sync.on_event(event, arg)``. An error in the latter
    must not cross the C++ hook: it is kept in ``sync.hook_error`` and raised at the end of
    backward (``GradSync.raise_hook_error``); the rest of that backward's events are dropped. The
    callbacks hold ``sync`` weakly: hooks live as long as the params and must not pin buffers.
    Not hooked yet (``GradSync.take_over`` attaches it once the optimizer's construction is done)."""
    ref = weakref.ref(sync)

    def on_param(index: int) -> None:
        me = ref()
        if me is not None:
            me.on_grad(me.by_stager_index[index])

    def on_event(event: int, arg: int) -> None:
        me = ref()
        if me is None or me.hook_error is not None:
            return
        try:
            me.on_event(event, arg)
        except BaseException as exc:  # noqa: BLE001 - re-raised at the end of backward
            me.hook_error = exc

    entries = sync.by_stager_index
    return make_stager(native, [e.param for e in entries], [e.bucket for e in entries],
                       [e.offset for e in entries], [e.nbytes for e in entries],
                       [s.expected for s in sync.states], [s.flush_bytes for s in sync.states],
                       on_event, on_param)


def quiet_end_callback(sync: Any) -> Callable[[], None]:
    """The native stager's quiet end for ``sync`` (``set_quiet_begin``): ``sync.quiet_end()``,
    holding ``sync`` weakly (the stager must not pin it). It raises nothing into the native
    caller: an error is queued as a callback of the same backward that raises it, so
    ``backward()`` raises it as it raises a queued Python callback's error (torch runs
    callbacks queued while its callbacks run)."""
    ref = weakref.ref(sync)

    def end() -> None:
        me = ref()
        if me is None:
            return
        try:
            me.quiet_end()
        except BaseException as exc:  # noqa: BLE001 - raised from backward() below
            def reraise(exc: BaseException = exc) -> None:
                raise exc

            _compat.queue_backward_callback(reraise)

    return end


_DRAINED_AT_EXIT: set = set()


def _drain_at_exit(native: Any) -> None:
    """Free what the release thread still holds before the interpreter (and CUDA) shut down: a
    script may end right after a backward, without a zero_grad."""
    if hasattr(native, "drain_released") and id(native) not in _DRAINED_AT_EXIT:
        _DRAINED_AT_EXIT.add(id(native))

        def drain() -> None:  # nothing may reach the thread once the interpreter finalizes
            native.set_async_release(False)
            native.drain_released()

        atexit.register(drain)


def _python_hooks_forced() -> bool:
    """``SHARDAMP_PYTHON_GRAD_HOOKS=1``: the Python hooks even where the native ones exist (to
    test both, or to rule the native hook out)."""
    return config.settings().python_grad_hooks


__all__ = ["PyStager", "make_stager", "for_grad_sync", "quiet_end_callback", "NONE", "SLOW", "FLUSH", "COMPLETE"]
