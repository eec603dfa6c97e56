"""Several DistributedFusedAdam over one process group: one order of reduce-scatters on every rank.

Each optimizer launches its buckets' reduce-scatters in a fixed order (grad_sync.py). Optimizers
over one process group share the group's sequence of collectives (gloo and NCCL pair the k-th
collective of a group on one rank with the k-th on every other, whatever each one is), so the
way their launches interleave must be the same on every rank too. Per backward pass (an autograd
graph task, one per ``backward()`` call):

* A backward that reaches the params of ONE optimizer of the group (backward A, then backward B;
  a GAN's generator loss through a frozen discriminator): that optimizer launches as it always
  does, each bucket as soon as it and those before it are complete, the rest at the end of the
  backward. The backward passes follow each other in program order, the same on every rank, so
  nothing interleaves, however many of the group's optimizers hold unstepped grads and in
  whichever order they step.
* A backward that reaches the params of SEVERAL (one loss through both models; the generator's
  loss through a discriminator whose params still require grad): none of them launches during
  it. ONE end-of-backward callback, queued at the group's first grad of the backward, ends the
  round of every optimizer that received grads, in build order: (the first built: every bucket),
  (the next: every bucket), ... The order the hooks fired in (other unused params per rank, other
  thread scheduling) and the order the optimizers' first grads came in (each one's own callback
  would run in that order: autograd runs a backward's callbacks in the order they were queued)
  no longer matter. Cost: those reduce-scatters no longer overlap that backward, and those
  optimizers hold their full-size grad buffers until its end (torch's ``param.grad`` memory).
* Which optimizers a backward reaches is asked of autograd at the group's first grad of it (no
  launch of the group has happened in it yet): whether the grad accumulator of a param another
  optimizer owns (requiring grad) is a node the current graph task runs. Only optimizers that
  launch during backward count (``overlap_grad_sync`` and not inside ``no_sync``): the others
  reduce at ``grad_sync()``/``step()``, in program order. An optimizer that receives grads in a
  round that another one launches in as it goes (a param autograd did not report) waits for
  the end of the backward and launches after it.
* A backward nested in one whose round is open, on the same thread (a reentrant backward:
  ``checkpoint(use_reentrant=True)``), joins that round: its optimizers launch at the end of the
  outer backward, after the one launching as it goes, in build order. (Where the ranks' graphs
  differ so much that the outer round is open before the nested backward on some ranks and not
  on others, the order can still differ; as with a single optimizer, whose number of rounds then
  differs, the ranks' collectives stop lining up: a bounded wait names each rank's position.)
* Backward passes over optimizers of one group running at the same time in several threads: the
  order of their launches depends on the threads' timing, on each rank. Refused: the optimizer
  whose round began while the other's was open launches nothing during its backward (it reduces
  at its ``step``, in program order), and both optimizers' next steps raise :func:`refusal` on
  every rank that saw it (it rides in the step's stats all-reduce: nothing trains).

With one optimizer over the group (or no peers: nothing to reduce) none of this runs: the first
grad of a backward queues the optimizer's own end-of-backward callback, as before.

This module decides; each GradSync acts, told through its methods (``defer_launches_to_end``,
``hold_launches_to_step``, ``refuse_next_step``, ``round_ended``): the launch flags are its own.
"""
from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from .. import _compat, param_tags


@dataclass(eq=False)
class _Round:
    """One backward's round over the group: who launches as it goes, who waits for the end."""

    task: int  # the graph task whose end-of-backward callback ends the round
    thread: int
    deferred: bool  # several optimizers reached: nobody launches before the end
    eager: Optional[Any] = None  # the GradSync launching as its buckets complete
    waiting: List[Any] = field(default_factory=list)  # GradSyncs launching at the end, build order
    refused: str = ""  # backward passes of two threads at once: the message

    def members(self) -> List[Any]:
        return ([self.eager] if self.eager is not None else []) + sorted(self.waiting, key=lambda s: s.build_index)


class GroupOrder:
    """The GradSyncs of one process group (build order) and the rounds open over it."""

    def __init__(self) -> None:
        self.syncs: List[weakref.ref] = []
        self.built = 0
        self.open: Dict[int, _Round] = {}
        self.lock = threading.Lock()

    def live(self) -> List[Any]:
        syncs = [s for s in (r() for r in self.syncs) if s is not None]
        if len(syncs) != len(self.syncs):
            self.syncs = [weakref.ref(s) for s in syncs]
        return syncs

    def begin(self, sync: Any) -> None:
        """``sync`` received the first grad of a backward (its ``callback_queued`` is now set)."""
        task, thread = _compat.graph_task_id(), threading.get_ident()
        with self.lock:
            r = self.open.get(task)
            if r is None:
                others = list(self.open.values())
                elsewhere = [o for o in others if o.thread != thread]
                if elsewhere:
                    r = self._new_round(task, thread, deferred=True)
                    r.refused = refusal(sync, [m for o in elsewhere for m in o.members()])
                    for o in elsewhere:
                        for member in o.members():
                            member.refuse_next_step(r.refused)
                elif others:  # nested in an open backward of this thread (reentrant): join it
                    r = others[0]
                else:
                    r = self._new_round(task, thread, deferred=self._several_launch(sync))
            if r.refused:
                sync.hold_launches_to_step(r.refused)
            if not r.deferred and r.eager is None and not r.waiting:
                r.eager = sync
                sync.defer_launches_to_end(False)
            else:
                r.waiting.append(sync)
                sync.defer_launches_to_end(True)

    def _new_round(self, task: int, thread: int, deferred: bool) -> _Round:
        r = _Round(task, thread, deferred)
        self.open[task] = r
        _compat.queue_backward_callback(lambda: self._end(task))
        return r

    def _several_launch(self, sync: Any) -> bool:
        """Whether this backward reaches two optimizers of the group that launch during it."""
        launching = 1 if sync.launches_in_backward() else 0
        for peer in self.live():
            if peer is not sync and peer.launches_in_backward() and _reached(peer):
                launching += 1
                if launching > 1:
                    return True
        return False

    def _end(self, task: int) -> None:
        """The end of the round's backward: each member's end of backward, in order (the one that
        launched as it went finishes first, then the others in build order)."""
        with self.lock:
            r = self.open.pop(task, None)
        if r is None:
            return
        error: Optional[BaseException] = None
        for sync in r.members():
            try:
                sync.round_ended()
            except BaseException as exc:  # noqa: BLE001 - every member ends; the first error is raised
                error = error or exc
        if error is not None:
            raise error

    def forget(self, sync: Any) -> None:
        """``sync`` dropped its grads (zero_grad): out of any round a failed backward left open."""
        with self.lock:
            for task, r in list(self.open.items()):
                if r.eager is sync:
                    r.eager = None
                r.waiting = [s for s in r.waiting if s is not sync]
                if r.eager is None and not r.waiting:
                    del self.open[task]


_groups: "weakref.WeakKeyDictionary[Any, GroupOrder]" = weakref.WeakKeyDictionary()
_world = GroupOrder()  # the default group (None)


def register(sync: Any) -> None:
    """Record ``sync`` (a GradSync over peers) among its group's, in build order."""
    key = sync.comm.group
    group = _world if key is None else _groups.setdefault(key, GroupOrder())
    with group.lock:
        group.live()
        group.syncs.append(weakref.ref(sync))
        sync.joined_group(group, group.built)
        group.built += 1


def begin(sync: Any) -> None:
    """The first grad of a backward reached ``sync``: queue its end of backward, alone (one
    optimizer over the group) or as a member of the group's round (several)."""
    group: Optional[GroupOrder] = sync.order_group
    if group is None or len(group.live()) < 2:
        _compat.queue_backward_callback(sync.end_of_backward)
        return
    group.begin(sync)


def forget(sync: Any) -> None:
    if sync.order_group is not None:
        sync.order_group.forget(sync)


def _reached(sync: Any) -> bool:
    """Whether the current graph task runs the grad accumulator of a param ``sync`` owns."""
    if not _compat.in_backward():
        return True
    nodes = sync.accumulators  # held where the native stager holds them anyway; None: looked up
    for k, entry in enumerate(sync.by_stager_index):
        p = entry.param
        if not p.requires_grad or param_tags.owner_token(p) is not sync.owner_token:
            continue
        if nodes is None:
            node = _compat.grad_accumulator(p)
        else:
            node = nodes[k]
            if node is None:
                node = nodes[k] = _compat.grad_accumulator(p)
        if _compat.reached_in_backward(node):
            return True
    return False


def refusal(sync: Any, others: List[Any]) -> str:
    members = sorted({id(s): s for s in [sync] + others}.values(), key=lambda s: s.build_index)
    names = ", ".join(describe(s) for s in members)
    return (
        "DistributedFusedAdam: optimizers over one process group received gradients in backward passes running at "
        f"the same time in several threads ({names}). The order their gradient reduce-scatters over the group "
        "are launched in then depends on the threads' timing, which differs between ranks (a hang, or one "
        "optimizer's grads summed with another's), so this step was skipped on every rank and nothing trained. "
        "Run the backward passes one after the other (in one thread, or join the first before starting the "
        "second) or give each optimizer its own process group (torch.distributed.new_group); call zero_grad() "
        "on each optimizer before training on."
    )


def describe(sync: Any) -> str:
    """How the error names an optimizer: its place in the group's build order and its params."""
    params = [e.param for e in sync.by_stager_index]
    shape = tuple(params[0].shape) if params else ()
    return f"optimizer #{sync.build_index + 1} built over the group ({len(params)} params, the first of shape {shape})"
