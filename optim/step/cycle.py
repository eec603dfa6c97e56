"""Where one optimizer is in its step cycle: the phase and every per-step counter and flag.

A :class:`StepCycle` is the one owner of the step's state. The grad hooks (sync/grad_sync.py)
tell it when a backward begins and when a reduction round is launched; the optimizer tells it
when the stats are reduced, the scale is known, the step ran and the grads were dropped; the
checks (checks/agreement.py, checks/deferred.py) read what they compare through its methods and
write nothing into it (the optimizer hands it the categories a step's agreement compared). The
host keeps no other per-step counter (the step health's counters live on the device:
step/health.py; the grad sync keeps only where its launches stand).

The phases, in order (``zero_grad`` may come at any point)::

    IDLE -> ACCUMULATING -> REDUCED -> UNSCALED -> STEPPED -> ACCUMULATING ...
             (backward)     (stats)    (scale)     (step)     (next backward)

A step without a scaler goes from ``REDUCED`` to ``STEPPED``; ``unscale_grads`` reduces the
stats first if nothing asked for them yet, so ``REDUCED`` always comes before ``UNSCALED``. A new
backward before the step (accumulating after a logged norm) goes back to ``ACCUMULATING`` and
the stats are computed anew. After ``zero_grad`` the phase is ``STEPPED`` when a step's norms
are still readable, else ``IDLE``.

The phase decides what may happen next, in one table (``_GATES``), as FSDP2's ``TrainingState``
gates its hooks: before a step, an unscale, a clip or a read of the grads the optimizer (and the
grads' reads, grads_view.py; torch's tools over them, torch_tools.py) asks :meth:`StepCycle.require`,
and an action out of order is refused there, with the error users get (the texts are in
checks/misuse.py). Per action the table names the phases that allow it and the facts it needs
beside the phase (:class:`Fact`), each with its refusal:

* a step needs a grad since the last ``zero_grad(set_to_none=True)`` (``zero_grad(set_to_none=
  False)`` keeps the grads as zeros whatever the phase says about the last step's norms);
* an unscale is refused while ``UNSCALED`` (a second one before the step); a clip made before it
  while the loss was scaled is warned of there, once;
* a norm read from the last step (phase ``STEPPED``, no collective) must be of a norm type that
  step computed;
* torch's clip and the reads of the grads as ``param.grad`` shows them are refused inside
  ``no_sync`` (the grads there are this rank's own), and ``local_grad``, which issues no
  collective to reduce with, while this rank holds grads not reduced yet.

The grad sync answers the last two facts (:class:`Reductions`, watched weakly: sync/grad_sync.py
registers itself); the cycle asks, never writes it.
"""
from __future__ import annotations

import enum
import warnings
import weakref
from typing import Any, Callable, Dict, FrozenSet, List, NamedTuple, Optional, Protocol, Sequence, Set, Tuple

from torch import Tensor

from ..checks.misuse import (CLIP_BEFORE_UNSCALE, NO_GRAD_AT_STEP, NORM_NOT_KEPT, READ_INSIDE_NO_SYNC, READ_UNREDUCED,
                             UNSCALE_TWICE)
from .step_round import StepRound


class StepPhase(enum.Enum):
    """The phase of one optimizer's step cycle (see the module docstring)."""

    # members are singletons compared by identity: hashed by it too, in C (Enum's own hash is a
    # Python call, and the gate looks a phase and an action up at every step)
    __hash__ = object.__hash__

    IDLE = "idle"  # no grads to step on, no step's norms to read
    ACCUMULATING = "accumulating"  # backward passes ran; the step's stats are not reduced yet
    REDUCED = "reduced"  # the one stats all-reduce ran: norms and found-inf are known
    UNSCALED = "unscaled"  # the loss scale is known (unscale_grads): norms are the true norms
    STEPPED = "stepped"  # the step consumed the grads; its norms stay readable until the next backward


class Action(enum.Enum):
    """What is asked of the cycle before it happens (:meth:`StepCycle.require`)."""

    __hash__ = object.__hash__  # as StepPhase's

    STEP = "step"  # DistributedFusedAdam.step
    UNSCALE = "unscale"  # unscale_grads: ShardedGradScaler.unscale_, torch's GradScaler hand-over
    NORM = "norm"  # grad_norm (opt.clip_grad_norm's too): after step, a norm type that step computed
    CLIP = "clip"  # torch's clip over param.grad: clip_grads_with_norm_ (torch's and shardamp's clip_grad_norm_)
    READ = "read"  # the grads as param.grad shows them: full_grad, p.grad's norms, get_total_norm, GradScaler.unscale_
    LOCAL_READ = "local read"  # local_grad: no collective, so nothing may be waiting for its reduction


class Fact(enum.Enum):
    """What an action needs beside the phase (``_GATES``)."""

    GRADS = "grads"  # a grad arrived since the last zero_grad(set_to_none=True)
    SYNCING = "syncing"  # outside no_sync (the grads accumulated inside are this rank's own)
    REDUCED = "reduced"  # no grad of this rank waits for a reduction (or a step consumed them)
    NORM_KEPT = "norm kept"  # outside STEPPED, or the last step computed the norm type asked for
    NO_SCALED_CLIP = "no scaled clip"  # no clip of this round was compared with a scaled norm (warns)


class Gate(NamedTuple):
    """One action's row of ``_GATES``: the phases allowing it and the error otherwise, the facts it
    needs with the error of each missing one, and a fact whose absence warns once."""

    phases: FrozenSet[StepPhase]
    out_of_phase: str
    needs: Tuple[Tuple[Fact, str], ...] = ()
    warns: Optional[Tuple[Fact, str]] = None


class Reductions(Protocol):
    """What the gate asks of the grad sync (sync/grad_sync.py's ``GradSync``)."""

    @property
    def enabled(self) -> bool: ...  # False inside no_sync

    def holds_unreduced(self) -> bool: ...


_ANY = frozenset(StepPhase)
_READ = ((Fact.SYNCING, READ_INSIDE_NO_SYNC),)
# The gate: raised on every rank alike where the ranks walk the same phases and facts (a read's
# refusal comes before its collectives).
_GATES: Dict[Action, Gate] = {
    Action.STEP: Gate(_ANY, "", ((Fact.GRADS, NO_GRAD_AT_STEP),)),
    Action.UNSCALE: Gate(_ANY - {StepPhase.UNSCALED}, UNSCALE_TWICE, warns=(Fact.NO_SCALED_CLIP, CLIP_BEFORE_UNSCALE)),
    Action.NORM: Gate(_ANY, "", ((Fact.NORM_KEPT, NORM_NOT_KEPT),)),
    Action.CLIP: Gate(_ANY, "", _READ),
    Action.READ: Gate(_ANY, "", _READ),
    Action.LOCAL_READ: Gate(_ANY, "", _READ + ((Fact.REDUCED, READ_UNREDUCED),)),
}


def _number(value: Any) -> Any:
    """A clip's max_norm as compared across ranks: a float (1 and 1.0 agree), ``"tensor"`` for a
    device tensor (never read on the host), else its repr."""
    if isinstance(value, Tensor):
        return "tensor"
    try:
        return float(value)
    except (TypeError, ValueError):
        return repr(value)


def _ignore(_held: bool) -> None:
    pass


class StepCycle:
    """The phase and the counters of one optimizer's step cycle.

    Args:
        avg_factor: what the grads are multiplied by for averaging (``1 / world_size`` or 1).
        avg_tensor: the same as a 0-d device tensor (no per-step host-to-device copy).
    """

    def __init__(self, avg_factor: float, avg_tensor: Tensor) -> None:
        self.avg_factor = avg_factor
        self.avg_tensor = avg_tensor
        self._phase = StepPhase.IDLE
        self._round: Optional[StepRound] = None  # this step's protocol, created when first asked
        self._last: Optional[StepRound] = None  # the last step's, readable until the next backward
        # grads: backward passes begun, reduction rounds launched since the last step, whether any
        # grad arrived since zero_grad, and whether a step consumed them since zero_grad
        self._backwards = 0
        self._rounds_since_step = 0
        # read by every param.grad of a managed param (torch_tools.py), so a plain attribute, not a
        # property; only this class writes it
        self.grad_since_zero = False  # a grad arrived since the last zero_grad(set_to_none=True)
        self._stepped_since_zero = False
        # where this rank is, for the message when the ranks' collectives do not line up
        self._steps_taken = 0
        self._backwards_at_step = 0
        self._dropped_rounds = 0
        self._drop_counted = False  # this zero_grad's dropped round is counted (a retried zero_grad counts once)
        # what the last step clipped: compared across ranks at the next step and at state reads
        self._last_clips: Tuple[Any, ...] = ()
        # this step's agreement: this rank's invalid hyperparameter, if any, and the categories
        # the stats' agreement entries compare, in order
        self._problem = ""
        self._names: List[str] = []
        self._warned: Set[str] = set()
        # grads reused (a backward or a step on grads a clip, an unscale or a step already
        # scaled): folds that coefficient into the kept shards first (GradsView.fold_pending)
        self._fold: Optional[Callable[[], None]] = None
        self._grads_held: Callable[[bool], None] = _ignore  # on_grads_held
        self._shown = False  # _grads_held(True) was called for the grads held since zero_grad
        self._unscaled_since_step = False  # a scaler's unscale_ reached this optimizer since its last step
        self._reductions: Callable[[], Optional[Reductions]] = lambda: None  # the grad sync, weakly (watch)

    # ------------------------------------------------------------------ the phase
    @property
    def phase(self) -> StepPhase:
        """Where the step is (see :class:`StepPhase`)."""
        return self._phase

    def current(self) -> StepRound:
        """This step's round, created at the first call after a backward, a step or zero_grad."""
        if self._round is None:
            self._round = StepRound(self.avg_factor, self.avg_tensor)
        return self._round

    def last_step(self) -> Optional[StepRound]:
        """The last step's round while no stats of a new step exist (its norms are readable
        without a collective), else None."""
        if self._last is not None and (self._round is None or self._round.stats is None):
            return self._last
        return None

    def watch(self, reductions: Reductions) -> None:
        """The grad sync whose state the gate asks (inside ``no_sync``, grads not reduced yet);
        held weakly: it holds this cycle."""
        self._reductions = weakref.ref(reductions)

    def require(self, action: Action, what: str = "", norm_type: float = 2.0) -> None:
        """The gate: raise unless the phase and the facts allow ``action`` now (``_GATES``); warn
        once where its row says (an unscale after a clip compared with the scaled norm).

        Args:
            action: what is about to happen.
            what: the call, named in a read's error.
            norm_type: the norm asked for (``Action.NORM``).

        Raises:
            RuntimeError: ``step`` with no grad since the last ``zero_grad`` on this rank (the
                params were replaced, or backward did not run); a second ``unscale_grads`` before
                the step; after ``step``, a norm type that step did not compute; torch's clip or a
                read of the grads inside ``no_sync``; ``local_grad`` while this rank holds grads
                not reduced yet. Local: no collective, no host sync.
        """
        gate = _GATES[action]
        if self._phase not in gate.phases:
            raise RuntimeError(gate.out_of_phase.format(what=what))
        for fact, refusal in gate.needs:
            if not self._holds(fact, norm_type):
                last = self._last
                computed = sorted(last.raw_norms) if last is not None else []
                raise RuntimeError(refusal.format(what=what, norm_type=norm_type, computed=computed))
        if gate.warns is not None and not self._holds(gate.warns[0], norm_type) and self.warn_once(
                f"{action.value}: {gate.warns[0].value}"):
            # stacklevel: this gate, unscale_grads, the scaler's unscale_ or step, the caller
            warnings.warn(gate.warns[1], UserWarning, stacklevel=4)

    def _holds(self, fact: Fact, norm_type: float) -> bool:
        if fact is Fact.GRADS:
            return self.grad_since_zero
        if fact is Fact.NORM_KEPT:
            last = self.last_step()
            return last is None or norm_type in last.raw_norms
        if fact is Fact.NO_SCALED_CLIP:
            return self._round is None or not self._round.clips_following_scale
        sync = self._reductions()
        if sync is None:  # no grad sync watched (a cycle alone): nothing is held back
            return True
        if fact is Fact.SYNCING:
            return sync.enabled
        return self._stepped_since_zero or not sync.holds_unreduced()  # Fact.REDUCED

    def last_norm(self, norm_type: float) -> Optional[Tensor]:
        """The last step's norm of ``norm_type`` (unscaled, no collective) while its norms are
        read (``last_step``), through the gate (a norm type it computed); None otherwise.

        Raises:
            RuntimeError: after ``step``, a norm type that step did not compute.
        """
        last = self.last_step()
        if last is None:  # this round's norm: nothing to refuse
            return None
        self.require(Action.NORM, norm_type=norm_type)
        return last.norm_after_step(norm_type)

    @property
    def inv_scale(self) -> Optional[Tensor]:
        """This step's inverse loss scale, once known."""
        return None if self._round is None else self._round.inv_scale

    @property
    def scaled(self) -> bool:
        """A scaler unscaled this step (its found-inf is acted on by the scaler)."""
        return self._round is not None and self._round.inv_scale is not None

    # ------------------------------------------------------------------ transitions
    def backward_began(self) -> bool:
        """A backward delivered its first grad to this optimizer: a new round starts (the last
        step's norms and any stats of an unfinished round are forgotten).

        Returns:
            True if a step consumed the grads since the last ``zero_grad`` (the new grads add to
            grads already stepped on: the caller warns).
        """
        stepped = self._stepped_since_zero
        # the new grads add to what param.grad showed, as in torch; with no grad since zero_grad
        # (a clip before any backward: torch's clips nothing) there is nothing to fold, and the
        # shards may be the grad hook's to land (its landing plan)
        held = self.grad_since_zero
        if held and self.holds_pending_coef() and self._fold is not None:
            self._fold()
        self._backwards += 1
        self._drop_counted = False
        self._stepped_since_zero = False
        self.grad_since_zero = True
        self._round, self._last = None, None
        self._phase = StepPhase.ACCUMULATING
        return stepped

    def backward_ended(self) -> None:
        """A backward that delivered grads to this optimizer finished (its end ran): from here on
        ``param.grad`` shows the held grads (``on_grads_held``). Not at the first grad: inside a
        backward both classes read autograd's field, and the switch (a class assignment per param)
        would delay the first bucket's reduction instead of running once every launch is queued."""
        if self.grad_since_zero and not self._shown:
            self._shown = True
            self._grads_held(True)

    def holds_pending_coef(self) -> bool:
        """The kept grads are shown (``param.grad``) times more than the averaging factor: a
        step consumed them (its coefficient), or this round unscaled or clipped them."""
        r = self._round
        return self._stepped_since_zero or (r is not None and (r.inv_scale is not None or bool(r.clips)))

    def on_grads_held(self, held: Callable[[bool], None]) -> None:
        """``held(True)`` when the optimizer holds grads once a backward ends (the first since
        ``zero_grad(set_to_none=True)``), ``held(False)`` when such a ``zero_grad`` drops them:
        what ``param.grad`` shows changes then (torch_tools.py ``GradClasses``)."""
        self._grads_held = held

    def set_fold(self, fold: Callable[[], None]) -> None:
        """``fold()`` multiplies the kept grads in place by what they are shown times beyond the
        averaging factor (called while this cycle still describes them)."""
        self._fold = fold

    def reuse_stepped(self) -> None:
        """A step, an unscale or a clip begins on grads a step consumed, without a backward in
        between (a second ``step()``): fold that step's coefficient into them and start a new
        round over them, as torch steps on the ``param.grad`` it left. Nothing when no step
        consumed them."""
        if not self._stepped_since_zero:
            return
        if self._fold is not None:
            self._fold()
        self._stepped_since_zero = False
        self._round, self._last = None, None
        self._phase = StepPhase.ACCUMULATING

    @property
    def unscaled_since_step(self) -> bool:
        """A scaler's ``unscale_`` reached this optimizer since its last step (a backward since
        may have folded it into the grads: torch's scaler does not unscale them again)."""
        return self._unscaled_since_step

    def round_launched(self) -> None:
        """Every bucket of a reduction round was launched (reduce-scatter)."""
        self._rounds_since_step += 1

    def reduced(self, problem: str, names: Sequence[str]) -> None:
        """The step's stats were all-reduced, with ``problem`` (this rank's invalid value, or
        "") and the agreement categories ``names`` in their entries."""
        self._problem, self._names = problem, list(names)
        if self._phase in (StepPhase.IDLE, StepPhase.ACCUMULATING, StepPhase.STEPPED):
            self._phase = StepPhase.REDUCED

    def unscaled(self, inv: Tensor) -> None:
        """The loss scale is known (``unscale_grads``)."""
        self.current().unscale(inv)
        self._unscaled_since_step = True
        self._phase = StepPhase.UNSCALED

    def stepped(self, clips: Sequence[Any], norm_types: Sequence[float], cache_after_step: bool) -> None:
        """The step consumed this round, applying ``clips`` (max_norms) and having computed
        ``norm_types``; its norms stay readable (``last_step``) until the next backward."""
        r = self.current()
        self._last_clips = (tuple(map(_number, clips)), tuple(sorted(map(float, norm_types))))
        self._steps_taken += 1
        self._backwards_at_step, self._dropped_rounds = self._backwards, 0
        self._rounds_since_step = 0
        self._stepped_since_zero = True
        self._unscaled_since_step = False
        r.cache_after_step = cache_after_step
        r.done()
        self._last, self._round = r, None
        self._phase = StepPhase.STEPPED

    def dropping(self) -> None:
        """``zero_grad`` is about to drop the grads: a round no step consumed counts as dropped
        (once: ``grads_dropped`` ends it)."""
        if self.grad_since_zero and not self._stepped_since_zero and not self._drop_counted:
            self._dropped_rounds += 1
            self._drop_counted = True

    def grads_dropped(self, set_to_none: bool) -> None:
        """``zero_grad`` dropped the grads (``dropping`` came first); the last step's norms stay
        readable until the next backward."""
        self.dropping()
        self._drop_counted = False
        self._stepped_since_zero = False
        if set_to_none and self.grad_since_zero:
            self.grad_since_zero = False
            if self._shown:
                self._shown = False
                self._grads_held(False)
        self._round = None
        self._phase = StepPhase.STEPPED if self._last is not None else StepPhase.IDLE

    def warn_once(self, key: str) -> bool:
        """True the first time ``key`` is asked: the caller warns once per optimizer."""
        if key in self._warned:
            return False
        self._warned.add(key)
        return True

    # ------------------------------------------------------------------ what the others read
    @property
    def backwards(self) -> int:
        """Backward passes begun so far."""
        return self._backwards

    @property
    def rounds_since_step(self) -> int:
        """Reduction rounds launched since the last step (compared across ranks every step)."""
        return self._rounds_since_step

    @property
    def stepped_since_zero(self) -> bool:
        """A step consumed the grads since the last ``zero_grad`` (they are reduced and stepped on)."""
        return self._stepped_since_zero

    def clips_of_last_step(self) -> Tuple[Any, ...]:
        """``(max_norms, norm types)`` the last step applied and computed; ``()`` before any. A
        method, so a view can hand it on without holding the optimizer."""
        return self._last_clips

    @property
    def problem(self) -> str:
        """This step's invalid value on this rank (the message), or ""."""
        return self._problem

    @property
    def names(self) -> List[str]:
        """The agreement categories of this step's stats entries, in order."""
        return self._names

    def position(self) -> Dict[str, int]:
        """Where this rank is: steps taken, backward passes and dropped rounds since the last
        step (named when the ranks' collectives do not line up: comm/order.py)."""
        return {"steps": self._steps_taken, "backwards": self._backwards - self._backwards_at_step,
                "dropped": self._dropped_rounds}
