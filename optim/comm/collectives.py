"""The one place that talks to torch.distributed: every collective the optimizer, its state
dicts, checkpoints and agreement checks issue goes through a :class:`Comm`.

A ``Comm`` spans the ranks one optimizer trains over, arranged as ``replicate x shard``:

* the SHARD dim splits every bucket: grads are reduce-scattered and params all-gathered over
  it, and each rank keeps optimizer state for ``1 / shard_size`` of the params;
* the REPLICATE dim holds copies of the same shard (hybrid sharding, as FSDP2's HSDP): each
  reduced grad shard is all-reduced over it, nothing else is;
* the WHOLE span (``world_size`` ranks) agrees on everything per step: the one stats all-reduce
  (norm, found-inf, touched params, agreement entries), the construction broadcast and checks.

Built by :func:`make_comm` from nothing (a single process, or WORLD), a process group (flat
sharding over it), or a 1-D / 2-D ``DeviceMesh`` (``(replicate, shard)``, the order FSDP2
uses). A single process is :class:`Comm` itself, whose collectives do nothing: callers never
branch on the world size to skip communication. A dim of size 1 does its part locally.

On gloo the collectives of each kind travel over a process group of their own (the step's small
all-reduces, the collective calls' agreement, the param all-gathers, the rest) and every wait on
the CPU is bounded, so ranks whose collectives do not line up get one clear error instead of
gloo's abort: ``collective_order.py``. On CUDA nothing waits on the host; a monitor thread
watches the collectives' completion instead: ``collective_watchdog.py``.

Version-dependent and private torch names stay in ``_compat.py``; this module calls it.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional

import torch
import torch.distributed as dist
from torch import Tensor

from .. import _compat
from . import order as collective_order, watchdog as collective_watchdog
from .order import AGREEMENT, ALL_GATHER, GRAD_READS, REDUCE_SCATTER, REPLICAS, SECOND_NORM, STATS

__all__ = ["Comm", "GroupComm", "make_comm", "all_reduce_max"]


class _Done:
    """The handle of a collective that completed locally (a dim of size 1)."""

    def wait(self, *args: Any, **kwargs: Any) -> bool:
        return True


DONE = _Done()


class Comm:
    """One process: every collective is a no-op (or a local copy). Subclasses communicate.

    Attributes: ``world_size`` / ``rank`` over the whole span; ``shard_size`` / ``shard_rank``
    over the shard dim (what the layout splits buckets by); ``replicate_size`` /
    ``replicate_rank`` over the replicate dim; ``group``: the process group of the whole span
    (``None`` = WORLD), also the key under which optimizers sharing collectives are tracked.
    """

    world_size = 1
    rank = 0
    shard_size = 1
    shard_rank = 0
    replicate_size = 1
    replicate_rank = 0
    group: Optional[Any] = None
    shard_group: Optional[Any] = None
    replicate_group: Optional[Any] = None
    # Policies that follow from having nothing to communicate (asked by callers instead of
    # comparing world sizes):
    # ``reduces_grads``: grads are reduced across ranks. False: a grad bucket IS its shard;
    # backward sums grads into it in place, with no separate full-size buffer and no staging
    # limit (grad_sync.py), and the shard is released at zero_grad as torch drops param.grad.
    reduces_grads = False
    # ``has_peers``: other ranks exist that must build and step identically: the agreement
    # checks (construction, per step, per collective call) and the order of collectives
    # between optimizers over one group matter (agreement.py, sync/backward_order.py). False: nothing
    # to disagree with.
    has_peers = False
    # ``gathers_params``: the shard dim splits buckets, so params are all-gathered after the step
    # (and a lower-precision param_sync_dtype needs a buffer of its own); False: the shard is the bucket.
    gathers_params = False
    # where the optimizer is, for the error when collectives do not line up (set by the optimizer:
    # ``{"steps": steps taken, "backwards": backward passes since the last step}``)
    context: Optional[Callable[[], Dict[str, int]]] = None

    def describe(self) -> str:
        return f"{self.replicate_size}x{self.shard_size}" if self.replicate_size > 1 else str(self.shard_size)

    def describe_span(self) -> str:
        """The whole span's group name, the same on every member (keys of the mismatch report)."""
        return _compat.group_name(self.group if self.group is not None else dist.group.WORLD)

    def position(self) -> Dict[str, int]:
        return dict(self.context()) if self.context is not None else {"steps": 0, "backwards": 0}

    def check(self) -> None:
        """Raise if this comm's collectives were found stuck (collective_watchdog.py); a host
        read after a collective (``agree_on_call``) calls it, as every collective does."""

    def all_groups(self) -> List[Any]:
        """Every process group this comm issues collectives over (what a failure aborts)."""
        return []

    # ------------------------------------------------------------ per step, the hot path
    def reduce_scatter(self, out: Tensor, full: Tensor) -> Any:
        """Async SUM reduce-scatter of ``full`` over the shard dim into ``out`` (this rank's
        slice); returns a handle with ``wait()``."""
        out.copy_(full)
        return DONE

    def reduce_replicas(self, shard: Tensor) -> Optional[Any]:
        """Async SUM all-reduce of a reduced grad shard over the replicate dim, in place; None
        when there is no replicate dim (nothing to wait for)."""
        return None

    def all_gather(self, full: Tensor, shard: Tensor) -> Optional[Any]:
        """Async all-gather of every shard-dim rank's ``shard`` into ``full`` (``shard`` may be
        this rank's slice of ``full``); None when the shard is the whole bucket."""
        return None

    def all_reduce_stats(self, stats: Tensor, op: Any) -> None:
        """The step's one small all-reduce, over the whole span, in place. Replicas hold the same
        grad shard, so with SUM only replicate rank 0 contributes the norm partial (``stats[0]``):
        the norm counts every element once whatever the mesh."""

    def all_reduce_shard_dim(self, tensor: Tensor, op: Any) -> None:
        """Synchronous all-reduce of ``tensor`` over the shard dim, in place: per-param values
        computed from this rank's grad shards (grads_view.py). Replicas hold the same shards, so
        nothing crosses the replicate dim (every replica gets the same result)."""

    # ------------------------------------------------------------ construction, checks, state
    def broadcast(self, tensor: Tensor) -> None:
        """Broadcast ``tensor`` from rank 0 of the whole span (every rank starts from its weights)."""

    def all_gather_span(self, out: Tensor, mine: Tensor) -> None:
        """Synchronous all-gather over the whole span (``out``: world_size * mine.numel())."""
        out.copy_(mine.reshape(-1))

    def all_gather_object(self, values: List[Any], obj: Any) -> None:
        """``values[r] = obj of rank r`` over the whole span (error paths only: pickles)."""
        values[0] = obj

    def all_reduce_async(self, tensor: Tensor, op: Any) -> Any:
        """Async all-reduce over the whole span (the per-call agreement flags: on gloo over a
        group of their own, so a call on some ranks never pairs with another small all-reduce)."""
        return DONE

    def all_reduce_max(self, tensor: Tensor) -> None:
        """Synchronous MAX all-reduce over the whole span, in place (a found-inf flag)."""

    def gather_shards(self, local: Tensor, to_first: bool) -> Optional[Tensor]:
        """Every shard-dim rank's ``local`` stacked to ``[shard_size, *local.shape]``; with
        ``to_first`` only on shard rank 0 (the others get None). Replicas hold the same shards,
        so this never crosses the replicate dim."""
        return local.unsqueeze(0)

    def all_gather_shard_sync(self, full: Tensor, shard: Tensor) -> None:
        """Synchronous :meth:`all_gather` (off the step path: loading a checkpoint)."""
        work = self.all_gather(full, shard)
        if work is not None:
            work.wait()


class GroupComm(Comm):
    """Flat sharding over ``shard_group`` (``None`` = WORLD), optionally replicated over
    ``replicate_group``; ``span_group`` covers both (``None`` = WORLD). On gloo with CPU params
    the step's small all-reduces go over ``control_group``, the collective calls' agreement over
    ``call_group`` and the all-gathers over ``gather_group`` (collective_order.py: each kind pairs
    only with its own kind), and waits are bounded; with CUDA params (or
    ``SHARDAMP_COLLECTIVE_WATCHDOG=force``) ``watchdog`` watches them instead."""

    def __init__(self, shard_group: Optional[Any], replicate_group: Optional[Any] = None,
                 span_group: Optional[Any] = None, shard_size: Optional[int] = None,
                 replicate_size: int = 1, device: Optional[torch.device] = None) -> None:
        self.group = span_group
        self.shard_group = shard_group
        self.replicate_group = replicate_group
        self.world_size = dist.get_world_size(span_group)
        self.rank = dist.get_rank(span_group)
        self.shard_size = dist.get_world_size(shard_group) if shard_size is None else shard_size
        self.shard_rank = dist.get_rank(shard_group) if self.shard_size > 1 else 0
        self.replicate_size = replicate_size
        self.replicate_rank = dist.get_rank(replicate_group) if replicate_size > 1 else 0
        self.reduces_grads = self.has_peers = self.world_size > 1  # make_comm builds a Comm for one rank
        self.gathers_params = self.shard_size > 1
        if self.shard_size * self.replicate_size != self.world_size:
            raise ValueError(f"device_mesh: {self.replicate_size} x {self.shard_size} ranks do not make the "
                             f"{self.world_size} ranks of the mesh")
        # gloo, CPU params: one group per kind of collective (collective_order.py); waits bounded
        # on the host there, watched from a monitor thread where the host does not wait (CUDA)
        # or when forced (collective_watchdog.py)
        side = collective_order.uses_side_groups(span_group, device)
        self.watchdog = collective_watchdog.Watchdog(self, device or torch.device("cpu")) \
            if collective_watchdog.wanted(device) else None
        self.bounded = side and self.watchdog is None
        self.control_group = collective_order.side_group(span_group, "control") if side else span_group
        self.call_group = collective_order.side_group(span_group, "calls") if side else span_group
        self.gather_group = shard_group
        if side and self.shard_size > 1:
            self.gather_group = collective_order.side_group(shard_group, "gather")

    def _handle(self, work: Any, what: str) -> Any:
        if self.bounded:
            return collective_order.BoundedWork(work, what, self)
        return collective_watchdog.WatchedWork(work, what, self.watchdog) if self.watchdog is not None else work

    def check(self) -> None:
        if self.watchdog is not None:
            self.watchdog.check()

    def all_groups(self) -> List[Any]:
        groups: List[Any] = []
        world = _compat.world_group()
        spans = [g if g is not None else world for g in  # None = WORLD here
                 (self.group, self.shard_group, self.control_group, self.call_group, self.gather_group)]
        for g in spans + ([self.replicate_group] if self.replicate_group is not None else []):
            if not any(g is x for x in groups):
                groups.append(g)
        return groups

    def reduce_scatter(self, out: Tensor, full: Tensor) -> Any:
        if self.shard_size == 1:
            return super().reduce_scatter(out, full)
        self.check()  # never issue over a communicator the watchdog aborted
        return self._handle(_compat.reduce_scatter(out, full, self.shard_group, async_op=True), REDUCE_SCATTER)

    def reduce_replicas(self, shard: Tensor) -> Optional[Any]:
        if self.replicate_size == 1:
            return None
        self.check()
        return self._handle(_compat.all_reduce_async(shard, dist.ReduceOp.SUM, self.replicate_group), REPLICAS)

    def all_gather(self, full: Tensor, shard: Tensor) -> Optional[Any]:
        if self.shard_size == 1:
            return None
        self.check()
        return self._handle(_compat.all_gather(full, shard, self.gather_group, async_op=True), ALL_GATHER)

    def all_reduce_stats(self, stats: Tensor, op: Any) -> None:
        if self.replicate_rank != 0 and op == dist.ReduceOp.SUM:
            stats[0].zero_()  # a MAX (inf norm) of equal partials needs no such care
        what = SECOND_NORM if stats.numel() <= 2 else STATS  # a second norm type's header only
        self.check()
        # control_group is the span's own group unless gloo's side groups are in use
        self._handle(_compat.all_reduce(stats, op, self.control_group, async_op=True), what).wait()

    def all_reduce_shard_dim(self, tensor: Tensor, op: Any) -> None:
        if self.shard_size == 1:
            return
        self.check()
        self._handle(_compat.all_reduce(tensor, op, self.shard_group, async_op=True), GRAD_READS).wait()

    def broadcast(self, tensor: Tensor) -> None:
        _compat.broadcast_from_group_rank0(tensor, self.group)

    def all_gather_span(self, out: Tensor, mine: Tensor) -> None:
        _compat.all_gather(out, mine, self.group, async_op=False)

    def all_gather_object(self, values: List[Any], obj: Any) -> None:
        dist.all_gather_object(values, obj, group=self.group)

    def all_reduce_async(self, tensor: Tensor, op: Any) -> Any:
        self.check()
        work = _compat.all_reduce_async(tensor, op, self.call_group)
        # bounded waits: the caller's own (it names the call); watched: the watchdog's
        return work if self.watchdog is None else collective_watchdog.WatchedWork(work, AGREEMENT, self.watchdog)

    def all_reduce_max(self, tensor: Tensor) -> None:
        _compat.all_reduce(tensor, dist.ReduceOp.MAX, self.group)

    def gather_shards(self, local: Tensor, to_first: bool) -> Optional[Tensor]:
        if self.shard_size == 1:
            return local.unsqueeze(0)
        flat = local.reshape(-1)
        if not to_first:
            out = torch.empty(self.shard_size * flat.numel(), dtype=local.dtype, device=local.device)
            _compat.all_gather(out, flat, self.shard_group, async_op=False)
            return out.view(self.shard_size, *local.shape)
        pieces = [torch.empty_like(flat) for _ in range(self.shard_size)] if self.shard_rank == 0 else None
        _compat.gather_to_group_rank0(flat, pieces, self.shard_group)
        return torch.stack(pieces).view(self.shard_size, *local.shape) if pieces is not None else None


def make_comm(process_group: Optional[Any] = None, device_mesh: Optional[Any] = None,
              device: Optional[torch.device] = None) -> Comm:
    """The :class:`Comm` for an optimizer's arguments (``process_group`` and ``device_mesh``
    exclude each other). Neither, with torch.distributed not initialised: a single process."""
    if process_group is not None and device_mesh is not None:
        raise ValueError("process_group and device_mesh were both given: pass one (device_mesh=mesh with a 1-D "
                         "mesh shards over it, a 2-D (replicate, shard) mesh shards over its last dim)")
    initialised = dist.is_available() and dist.is_initialized()
    if device_mesh is not None:
        return _mesh_comm(device_mesh, device, initialised)
    if process_group is None:
        if not initialised:
            return Comm()
        return GroupComm(None, span_group=None, device=device) if dist.get_world_size() > 1 else _one_rank(None)
    if not initialised:
        raise ValueError("process_group was given but torch.distributed is not initialised")
    if dist.get_rank(process_group) < 0:
        raise ValueError("process_group: this rank is not a member of the given group")
    if dist.get_world_size(process_group) == 1:
        return _one_rank(process_group)
    return GroupComm(process_group, span_group=process_group, device=device)


def _one_rank(group: Optional[Any]) -> Comm:
    comm = Comm()
    comm.group = group  # still the key that tells optimizers over different groups apart
    return comm


def _mesh_comm(mesh: Any, device: Optional[torch.device], initialised: bool) -> Comm:
    if not initialised:
        raise ValueError("device_mesh was given but torch.distributed is not initialised")
    if not _compat.is_device_mesh(mesh):
        raise ValueError(f"device_mesh={mesh!r}: expected a torch.distributed.device_mesh.DeviceMesh "
                         "(init_device_mesh(device_type, (replicate, shard)))")
    if mesh.ndim not in (1, 2):
        raise ValueError(f"device_mesh: a {mesh.ndim}-D mesh; expected 1-D (shard) or 2-D (replicate, shard)")
    if device is not None and mesh.device_type != device.type:
        raise ValueError(f"device_mesh: a '{mesh.device_type}' mesh for params on '{device.type}'; build the "
                         f"mesh with init_device_mesh('{device.type}', ...)")
    if mesh.get_coordinate() is None:
        raise ValueError("device_mesh: this rank is not a member of the mesh")
    sizes = tuple(mesh.shape)
    replicate, shard = (1, sizes[0]) if mesh.ndim == 1 else sizes
    if replicate * shard == 1:
        return Comm()
    span = None if replicate * shard == dist.get_world_size() else _compat.flat_mesh_group(mesh)
    shard_group = mesh.get_group(mesh.ndim - 1) if shard > 1 else None
    replicate_group = mesh.get_group(0) if replicate > 1 else None
    return GroupComm(shard_group, replicate_group, span, shard_size=shard, replicate_size=replicate, device=device)


def all_reduce_max(tensor: Tensor, group: Optional[Any]) -> None:
    """MAX all-reduce over ``group`` (the scaler's found-inf for optimizers other than
    shardamp's): nothing without torch.distributed or on a group of one. Called every scaler
    step, so it builds no Comm (whose construction may create process groups)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1:
        return
    _compat.all_reduce(tensor, dist.ReduceOp.MAX, group)
