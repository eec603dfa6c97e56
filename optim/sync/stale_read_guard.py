"""``opt.attach(model)``: no param is read stale during ``model``'s forward, wherever it is read.

With ``overlap_param_sync=True`` the all-gathers of the step are still in flight when the next
forward starts; the global module pre-hook (param_sync.py) waits for the buckets of a module's
OWN params before the module runs. A param read anywhere else in the forward (the root's own
forward body reading a child's weight, a helper function, a module that borrows a weight without
registering it) would see last step's values. While an attached model's forward runs, this
TorchFunctionMode looks at the tensors every torch op receives and, for a param whose bucket is
still in flight, waits for that bucket first. When the forward returns, whatever is still in
flight is waited for, so code after the forward reads current params too.

The mode is entered by the model's forward pre-hook and left by its forward hook
(``always_call=True``, so also when the forward raises); modes a user enters inside the forward
are left before it returns, so the stack stays balanced. While no bucket is in flight each op
costs one dictionary check.
"""
from __future__ import annotations

import weakref
from typing import Any, List

import torch
from torch.overrides import TorchFunctionMode


class _Guard(TorchFunctionMode):
    def __init__(self, sync_ref: "weakref.ReferenceType") -> None:
        super().__init__()
        self.sync_ref = sync_ref

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        sync = self.sync_ref()
        if sync is not None and sync.pending:
            for a in (*args, *kwargs.values()):
                if isinstance(a, (list, tuple)):
                    for b in a:
                        sync.wait_for_param(b)
                else:
                    sync.wait_for_param(a)
        return func(*args, **kwargs)


class StaleReadGuard:
    """The hooks ``attach`` puts on one model; ``remove()`` takes them off."""

    def __init__(self, sync: Any, model: torch.nn.Module) -> None:
        ref = weakref.ref(sync)
        active: List[_Guard] = []

        def enter(module, inputs):
            guard = _Guard(ref)
            guard.__enter__()
            active.append(guard)

        def leave(module, inputs, output):
            if active:
                active.pop().__exit__(None, None, None)
            me = ref()
            if me is not None and not active:
                me.wait()  # what the forward did not read is read after it: land it now

        self.handles = [
            model.register_forward_pre_hook(enter),
            model.register_forward_hook(leave, always_call=True),
        ]

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []
