"""Host-side reads of per-step device flags without a host sync on the step path.

After each step the optimizer records ``[found_inf, invalid tensor max_norm, agreement flags...,
health record]`` here, or the health record alone where found-inf is the only flag (the record's
reason says it), except a step its scaler unscaled whose only flag is found-inf: the scaler acts
on it, nothing is left for the host to read. On the CPU the values are read at once (reading is free), and the agreement flags are
already read right after the stats all-reduce (``check_now``), before anything trains. On CUDA they are copied, non-blocking, into pinned
memory behind an event, and read at the start of the NEXT step's stats, when that copy finished
long ago (``event.query()``; only a host that ran a whole step ahead of its GPU waits), and
every rank reads at the same point, so every rank raises (or warns) alike. During CUDA-graph
capture nothing is recorded (the device still skips mismatched steps; only the host-side
message is lost). The health record's values go to the optimizer's StepHealth (health.py:
the non-finite report's all-gather, the logger, the no-scaler skip warning).
"""
from __future__ import annotations

from typing import Any, List, Optional

import torch
from torch import Tensor

from .. import _compat
from . import agreement


class DeferredChecks:
    """The step's device flags, read on the host where that costs no sync.

    Args:
        device: the optimizer's device.
        cycle: the step cycle (step/cycle.py), read for the step's agreement categories, its
            invalid value and whether a scaler unscaled it.
        health: the optimizer's StepHealth (step/health.py), handed each step's health record.
    """

    def __init__(self, device: torch.device, cycle: Any = None, health: Any = None) -> None:
        self.device = device
        self.cuda = device.type == "cuda"  # asked every step: a device's .type makes a new string
        self.cycle = cycle
        self.health = health
        self.pending: Optional[tuple] = None  # (host buffer, event or None, context)
        # Two (pinned buffer, event) slots, used in turn (on the CPU: plain buffers the step's
        # native call writes the record into, no event). A step's flags are read at the
        # start of the next step's stats, before that step pushes into the other slot, so a slot
        # is written again only after it was read; reusing them spares the pinned allocator's
        # events and queries and an event creation per step on the host. A slot is made anew
        # when the flags' shape changes (the checks a step makes changed).
        self.slots: List[Optional[tuple]] = [None, None]
        self.turn = 0
        # the slot the step's scalar launch writes the health record into itself (record_target),
        # taken by record_step: (its turn, (pinned buffer, event))
        self.planned: Optional[tuple] = None

    def push(self, flags: Tensor, context: dict) -> None:
        """Record ``flags`` (float32 ``[found_inf, clip invalid, invalid, mismatch per category...]``
        on the device; the last parts only where they were checked: ``context`` says)."""
        if self.cuda and _compat.cuda_capturing():
            return
        self._push(flags, context)

    def _slot(self, turn: int, like: Tensor) -> tuple:
        """Slot ``turn``'s (pinned buffer, event), made anew if ``like``'s shape or dtype changed;
        on the CPU a plain buffer and no event (read at once)."""
        slot = self.slots[turn]
        if slot is None or slot[0].shape != like.shape or slot[0].dtype != like.dtype:
            slot = self.slots[turn] = (torch.empty(like.shape, dtype=like.dtype, pin_memory=self.cuda),
                                       torch.cuda.Event() if self.cuda else None)
        return slot

    def _push(self, flags: Tensor, context: dict, fresh: bool = False) -> None:
        """``push`` where the caller knows no CUDA graph is being captured; ``fresh``: ``flags``
        is a new tensor nothing else holds (kept as it is on the CPU, not copied)."""
        if self.cuda:
            self.turn ^= 1
            host, event = self._slot(self.turn, flags)
            host.copy_(flags, non_blocking=True)
            # where the copy ran, whatever device is current
            _compat.cuda_event_record(event, _compat.cuda_current_stream(flags.device))
            self.pending = (host, event, context)
        else:
            self.pending = (flags if fresh else flags.detach().clone(), None, context)

    def _capturing(self, capturing: Optional[bool]) -> bool:
        """Whether a CUDA graph is being captured on the current stream: ``capturing`` where the
        caller asked once for several calls of one step (each query is microseconds of host time on
        a GPU host), else asked here."""
        if capturing is not None:
            return capturing
        return self.cuda and _compat.cuda_capturing()

    def record_target(self, stats: Any, bad_clip: Optional[Tensor], record: Tensor,
                      capturing: Optional[bool] = None) -> Optional[Tensor]:
        """Where the step's scalar launch writes the health ``record`` for the host itself, or
        None (``stats``: the step's GradStats, or None where the step's own native call finishes
        them: one process, nothing compared, so no disagreement flags).
        None. Where :meth:`record_step` will push the record alone (found-inf is the only flag
        and no scaler acts on it), it is the next slot: on CUDA a pinned one the kernel writes
        through its mapped address, so the push is an event record, no device-to-host copy (~50
        us of host time a step on a GPU host); on the CPU a persistent buffer the same native
        call fills, so the push copies nothing (no clone). Called before the step's scalar launch."""
        self.planned = None
        if (bad_clip is not None or (stats is not None and stats.disagreement is not None) or self.cycle.scaled
                or self._capturing(capturing)):
            return None
        turn = self.turn ^ 1  # the slot read before this step's stats, not the one pending
        self.planned = (turn, self._slot(turn, record))
        return self.planned[1][0]

    def ready(self, force: bool, capturing: Optional[bool] = None) -> Optional[tuple]:
        """The recorded ``(values: list of floats, context)`` if they may be read now: always on the CPU; on
        CUDA only when ``force`` (the next step), never during graph capture."""
        if self.pending is None:
            return None
        host, event, context = self.pending
        if event is not None:
            if not force or self._capturing(capturing):
                return None
            if not _compat.cuda_event_query(event):  # recorded a step ago: practically always complete already
                event.synchronize()
        self.pending = None
        values: List[float] = host.tolist()
        return values, context


    def record_step(self, stats: Any, bad_clip: Optional[Tensor] = None, capturing: Optional[bool] = None) -> None:
        """Queue this step's flags for the host (no sync on CUDA), and act on them where readable.
        ``bad_clip``: the device flag of an invalid tensor ``max_norm`` (hparams.clip_invalid);
        ``capturing``: whether a CUDA graph is being captured, where the step asked already."""
        if self._capturing(capturing):
            return  # nothing is recorded under capture (push): no launch for the flags either
        flags = [] if bad_clip is None else [bad_clip.reshape(1)]
        if stats.disagreement is not None:
            flags.append(stats.disagreement)
        scaled = self.cycle.scaled
        if not flags and scaled:
            # found-inf alone, and a scaler unscaled this step: it acts on found-inf itself (lowers
            # the scale) and a scaled step never counts as a skip without a scaler, so there is
            # nothing to read back: no device-to-host copy and no event (~70 us of host time on a
            # GPU host, per step); the step's health stays on the device (step_stats() reads it)
            return
        record = self.health.pushed_record()
        context = self._context(clip_checked=bad_clip is not None, scaled=scaled)
        context["step"], context["record"] = self.health.steps, record.numel()
        if not flags:  # found-inf alone: the record's reason says it; the record is pushed as it is, no cat
            context["record_only"] = True
            planned, self.planned = self.planned, None
            if planned is not None:  # the scalar launch wrote the record into this slot (record_target)
                self.turn, (host, event) = planned
                if event is not None:
                    _compat.cuda_event_record(event, _compat.cuda_current_stream(record.device))
                self.pending = (host, event, context)
            else:
                self._push(record, context)  # not capturing: checked above
        else:
            self._push(torch.cat([stats.found_inf.reshape(1), *flags, record]), context, fresh=True)
        if self.pending is not None and self.pending[1] is None:  # readable now (CPU); CUDA's at the next step
            self.check_last_step(force=False)

    def check_now(self, stats: Any) -> None:
        """Where reading is free (CPU): act on the stats' agreement flags right after the
        all-reduce, before anything trains or another collective runs (the same rules as a
        recorded step's flags, read at once)."""
        _raise_if_flagged([0.0] + stats.disagreement.tolist(), self._context(clip_checked=False))

    def _context(self, clip_checked: bool, scaled: Optional[bool] = None) -> dict:
        cycle = self.cycle
        return {"scaled": cycle.scaled if scaled is None else scaled, "names": cycle.names, "problem": cycle.problem,
                "clip_checked": clip_checked}

    def check_last_step(self, force: bool, capturing: Optional[bool] = None) -> None:
        """Act on a recorded step's flags once readable: raise on disagreement or an invalid
        value (on CUDA at the next step: the device skipped that step already), and hand the
        step's health record to the StepHealth (on every rank at the same point: it may
        all-gather the ranks' non-finite flags, log and warn)."""
        got = self.ready(force, capturing)
        if got is None:
            return
        values, context = got
        _raise_if_flagged(values, context)
        if "step" in context:
            self.health.observe(context["step"], values[-context["record"]:], scaled=context["scaled"])


def _raise_if_flagged(values: List[float], context: dict) -> None:
    """``values``: ``[found_inf, clip invalid (if checked), invalid, mismatch per category...]``,
    then a step's record; a push of the record alone has no flags."""
    if context.get("record_only"):
        return
    rest = values[1:]
    if "step" in context:  # a step's record: its health record ends it
        rest = rest[:-context["record"]]
    if context["clip_checked"]:
        if rest[0] > 0:
            raise ValueError(
                "clip_grad_norm: max_norm is a tensor holding NaN or a negative value (checked on the device); "
                "the step was skipped. Pass a max_norm >= 0 (negative would ascend, NaN never clips)."
            )
        rest = rest[1:]
    if rest:
        agreement.raise_if_disagree(rest[0], rest[1:], context["names"], context["problem"])
