"""After the step: every rank's updated shard is all-gathered into the flat param buffers, which
the model params are views of, so the model is updated in place.

With ``overlap=False`` the all-gathers are waited for at once. With ``overlap=True`` they stay in
flight and a global module forward pre-hook waits, before a module runs, for the buckets holding
that module's own params; ``wait()`` (``opt.param_sync()``) waits for all of them. Reads elsewhere
in a forward are guarded by ``opt.attach(model)`` (stale_read_guard.py); code between ``step``
and the next forward must call ``param_sync()`` before reading params.
"""
from __future__ import annotations

import weakref
from typing import Dict, List, Sequence

import torch

from ..shards.buffers import BucketBuffers
from ..comm.collectives import Comm
from ..layout import Bucket


class ParamSync:
    def __init__(
        self,
        buckets: List[Bucket],
        buffers: List[BucketBuffers],
        params: Sequence[torch.nn.Parameter],
        comm: Comm,
        overlap: bool,
    ) -> None:
        self.buckets = buckets
        self.buffers = buffers
        self.comm = comm
        self.overlap = overlap
        self.pending: Dict[int, object] = {}
        self.bucket_of = {id(params[s.index]): b.index for b in buckets for s in b.slots}
        self.hook_handle = None
        if overlap and comm.gathers_params:  # else nothing is ever in flight
            ref = weakref.ref(self)  # the global hook must not keep the optimizer alive

            def pre_forward(module, inputs):
                me = ref()
                if me is not None:
                    me._pre_forward(module, inputs)

            self.hook_handle = torch.nn.modules.module.register_module_forward_pre_hook(pre_forward)

    def __del__(self) -> None:
        self.remove_hooks()

    @property
    def gathers(self) -> bool:
        """Whether the step's shards are all-gathered (several shard ranks); else ``launch`` does nothing."""
        return self.comm.gathers_params

    def launch(self, i: int) -> None:
        """All-gather bucket ``i``'s updated shard. The step calls this right after the bucket's
        kernel, in ``layout.forward_order``, identical on every rank: each all-gather overlaps
        the next bucket's step kernel, and with ``overlap`` the first module's params land
        first. Over the shard dim only: replicas computed the same shard."""
        buf = self.buffers[i]
        full = buf.sync if buf.sync is not None else buf.params
        work = self.comm.all_gather(full, full[buf.shard])
        if work is not None:
            self.pending[i] = work

    def launched_all(self) -> None:
        """End of the step: without ``overlap`` the params must be complete when step returns."""
        if not self.overlap and self.pending:
            self.wait()

    def _finish(self, i: int) -> None:
        work = self.pending.pop(i)
        work.wait()
        buf = self.buffers[i]
        if buf.sync is not None:
            # the cast pass: every rank, this one too, holds the same rounded model (the
            # master is a separate tensor whenever a sync buffer exists)
            buf.params.copy_(buf.sync)

    def wait(self) -> None:
        for i in sorted(self.pending):
            self._finish(i)

    def _pre_forward(self, module: torch.nn.Module, _inputs) -> None:
        if not self.pending:
            return
        for p in module.parameters(recurse=False):
            i = self.bucket_of.get(id(p))
            if i is not None and i in self.pending:
                self._finish(i)

    def wait_for_param(self, t: object) -> None:
        """If ``t`` is one of the params and its bucket is in flight, wait for that bucket."""
        i = self.bucket_of.get(id(t))
        if i is not None and i in self.pending:
            self._finish(i)

    def remove_hooks(self) -> None:
        if self.hook_handle is not None:
            self.hook_handle.remove()
            self.hook_handle = None
