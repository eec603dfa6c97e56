"""The bucket reductions in flight (several ranks): each bucket's reduce-scatter, and with hybrid
sharding its reduced shard's all-reduce over the replicas, from launch until it has landed in the
bucket's grad shard.

On CUDA each landing is queued on a side stream as soon as the bucket is launched: it waits for
the collective there, adds the reduced shard in where it accumulates, and computes the bucket's
norm partial into the shared statistics row, all hidden under the rest of backward; ``wait``
joins the streams where the shard is consumed. On CPU ranks (gloo) the host waits for the
oldest reductions so that at most ``MAX_IN_FLIGHT`` full-size inputs are held at once: backward
keeps O(bucket_cap_mb) of unreduced grads, not the model's (ZeRO-2).
"""
from __future__ import annotations

from typing import Any, List, Optional

import torch
from torch import Tensor

from .. import _compat
from ..comm.collectives import Comm
from ..kernels import partials
from .grad_state import BucketGrads, Reduction

MAX_IN_FLIGHT = 2  # reductions whose full-size input a CPU rank holds at once


class Reductions:
    """The reductions of one optimizer's buckets that have been launched and not yet waited for.

    Args:
        comm: the optimizer's collectives.
        side: the side stream the landings are queued on (CUDA), or None (the host waits).
        partials_row: the shared statistics row the side stream adds each bucket's partial into.
        host: the optimizer's ``HostState`` (shards/host_state.py): told of each landed shard, so an
            offloaded bucket's copy to the host starts as it lands.
    """

    def __init__(self, comm: Comm, side: Optional[torch.cuda.Stream], partials_row: Tensor, host: Any) -> None:
        self.comm = comm
        self.side = side
        self.partials_row = partials_row
        self.host = host
        self.pending: List[Reduction] = []
        self._joined: Optional[torch.cuda.Event] = None  # the side stream's join point, recorded anew at each join

    def launch(self, s: BucketGrads, full: Tensor, accumulate: bool, free_full: bool, first_partial: bool) -> bool:
        """Reduce-scatter ``full`` (bucket ``s``'s grads on this rank) into its grad shard, added to
        what the shard holds where ``accumulate``. A collective. ``free_full``: the caller drops
        ``full`` at once (its memory is reused only after the collective read it).

        Returns:
            True where the bucket's norm partial is formed with the landing (the side stream):
            ``first_partial`` then zeroes the shared row first.
        """
        out = torch.empty_like(s.buffers.grad_shard) if accumulate else s.buffers.grad_shard
        work = self.comm.reduce_scatter(out, full)
        if self.side is not None:
            self._land_on_side_stream(s, work, out, accumulate, first_partial, full if free_full else None)
            self.pending.append(Reduction(s, work=None, full=None, out=None, accumulate=False, scattered=True))
            return True
        self.pending.append(Reduction(s, work=work, full=full, out=out, accumulate=accumulate, scattered=False))
        self._retire(MAX_IN_FLIGHT)
        return False

    def _land_on_side_stream(self, s: BucketGrads, work, out: Tensor, accumulate: bool, first_partial: bool,
                             full: Optional[Tensor]) -> None:
        """Queue, on the side stream: wait for bucket ``s``'s reduction, accumulate it, and
        compute its stats partial. The host does not wait; ``wait()`` joins the streams."""
        shard = s.buffers.grad_shard
        self.side.wait_stream(torch.cuda.current_stream(self.side.device))
        with torch.cuda.stream(self.side):
            work.wait()
            # issued on the side stream: it starts once the reduce-scatter has landed
            replicas = self.comm.reduce_replicas(out)
            if replicas is not None:
                replicas.wait()
            if accumulate:
                shard.add_(out)
            if first_partial:  # every partial is redone this round
                self.partials_row.zero_()
            partials.accumulate_partial(shard, s.partial, 2.0)
            self.host.landed(s.index, shard)  # an offloaded bucket's copy, queued behind the landing
        # freed by the caller right away: the allocator reuses the memory only once the side
        # stream (which waited for the collective) has passed this point
        out.record_stream(self.side)
        if full is not None:
            full.record_stream(self.side)

    def _retire(self, keep: int) -> None:
        """Wait (on the host: CPU/gloo) for the oldest reduce-scatters until at most ``keep``
        hold a full-size buffer. A landed shard's all-reduce over the replicas is launched here,
        waited in ``wait``."""
        held = [r for r in self.pending if not r.scattered]
        for r in held[: max(len(held) - keep, 0)]:
            r.work.wait()
            r.full, r.scattered = None, True
            r.work = self.comm.reduce_replicas(r.out)
            if r.work is None:
                _land(r, self.host)

    def wait(self) -> None:
        """Every reduction in flight has landed in its shard (on CUDA: the compute stream waits
        for the side stream; the host does not)."""
        self._retire(0)
        for r in self.pending:
            if r.work is not None:
                r.work.wait()
                _land(r, self.host)
        if self.side is not None and self.pending:
            # join: the compute stream resumes after every landing; only then may the
            # buffers the side stream read be freed (they are dropped with ``pending``)
            self._join_side()
        self.pending.clear()

    def _join_side(self) -> None:
        """The compute stream waits for everything queued on the side stream so far. One event,
        recorded again at each join (a wait takes the record made before it), and the current
        stream found without torch.cuda's Python frames (``_compat.cuda_current_stream``):
        ``wait_stream`` and ``current_stream()`` create an event and resolve the current device in
        Python, tens of microseconds of host time a step on a GPU host."""
        if self._joined is None:
            self._joined = torch.cuda.Event()
        self._joined.record(self.side)
        _compat.cuda_current_stream(self.side.device).wait_event(self._joined)

    def held_inputs(self) -> List[Tensor]:
        """The full-size inputs still held by reductions in flight."""
        return [r.full for r in self.pending if r.full is not None]


def _land(r: Reduction, host: Any) -> None:
    if r.accumulate:
        r.bucket.buffers.grad_shard.add_(r.out)
    r.work, r.out, r.accumulate = None, None, False
    host.landed(r.bucket.index, r.bucket.buffers.grad_shard)
