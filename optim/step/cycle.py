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
gates its hooks: the optimizer asks :meth:`StepCycle.require` before a step or an unscale, and an
action out of order is refused there with the error users get (a clip made before the unscale,
while the loss was scaled, is warned of there, once). A step also needs grads: a grad
since the last ``zero_grad(set_to_none=True)``, a fact beside the phase (``zero_grad(set_to_none=
False)`` keeps the grads as zeros whatever the phase says about the last step's norms).
"""
from __future__ import annotations

import enum
import warnings
from typing import Any, Callable, Dict, FrozenSet, List, Optional, Sequence, Set, Tuple

from torch import Tensor

from ..checks.misuse import CLIP_BEFORE_UNSCALE, NO_GRAD_AT_STEP, UNSCALE_TWICE
from .step_round import StepRound


class StepPhase(enum.Enum):
    """The phase of one optimizer's step cycle (see the module docstring)."""

    IDLE = "idle"  # no grads to step on, no step's norms to read
    ACCUMULATING = "accumulating"  # backward passes ran; the step's stats are not reduced yet
    REDUCED = "reduced"  # the one stats all-reduce ran: norms and found-inf are known
    UNSCALED = "unscaled"  # the loss scale is known (unscale_grads): norms are the true norms
    STEPPED = "stepped"  # the step consumed the grads; its norms stay readable until the next backward


class Action(enum.Enum):
    """What the optimizer asks the cycle to allow (:meth:`StepCycle.require`)."""

    STEP = "step"  # DistributedFusedAdam.step
    UNSCALE = "unscale"  # unscale_grads: ShardedGradScaler.unscale_, torch's GradScaler hand-over


_ANY = frozenset(StepPhase)
# Per action: the phases that allow it, whether it needs grads since zero_grad, and the error of
# the action out of order (raised on every rank alike: the ranks walk the same phases).
_GATES: Dict[Action, Tuple[FrozenSet[StepPhase], bool, str]] = {
    Action.STEP: (_ANY, True, NO_GRAD_AT_STEP),
    Action.UNSCALE: (_ANY - {StepPhase.UNSCALED}, False, UNSCALE_TWICE),
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
        self._grad_since_zero = False
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
        self._unscaled_since_step = False  # a scaler's unscale_ reached this optimizer since its last step

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

    def require(self, action: Action) -> None:
        """The gate: raise unless the phase allows ``action`` now (``_GATES``); an unscale after
        a clip of this round warns once (the clip's max_norm was compared with the scaled norm).

        Raises:
            RuntimeError: ``step`` with no grad since the last ``zero_grad`` on this rank (the
                params were replaced, or backward did not run); a second ``unscale_grads`` before
                the step.
        """
        phases, needs_grads, refusal = _GATES[action]
        if self._phase not in phases or (needs_grads and not self._grad_since_zero):
            raise RuntimeError(refusal)
        if (action is Action.UNSCALE and self._round is not None and self._round.clips_following_scale
                and self.warn_once("clip before unscale")):
            # stacklevel: this gate, unscale_grads, the scaler's unscale_ or step, the caller
            warnings.warn(CLIP_BEFORE_UNSCALE, UserWarning, stacklevel=4)

    @property
    def inv_scale(self) -> Optional[Tensor]:
        """This step's inverse loss scale, once known."""
        return None if self._round is None else self._round.inv_scale

    @property
    def scaled(self) -> bool:
        """A scaler unscaled this step (its found-inf is acted on by the scaler)."""
        return self.inv_scale is not None

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
        if self._grad_since_zero and self.holds_pending_coef() and self._fold is not None:
            self._fold()
        self._backwards += 1
        self._drop_counted = False
        self._stepped_since_zero = False
        self._grad_since_zero = True
        self._round, self._last = None, None
        self._phase = StepPhase.ACCUMULATING
        return stepped

    def holds_pending_coef(self) -> bool:
        """The kept grads are shown (``param.grad``) times more than the averaging factor: a
        step consumed them (its coefficient), or this round unscaled or clipped them."""
        r = self._round
        return self._stepped_since_zero or (r is not None and (r.inv_scale is not None or bool(r.clips)))

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
        self._last_clips = (tuple(_number(c) for c in clips), tuple(sorted(float(t) for t in norm_types)))
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
        if self._grad_since_zero and not self._stepped_since_zero and not self._drop_counted:
            self._dropped_rounds += 1
            self._drop_counted = True

    def grads_dropped(self, set_to_none: bool) -> None:
        """``zero_grad`` dropped the grads (``dropping`` came first); the last step's norms stay
        readable until the next backward."""
        self.dropping()
        self._drop_counted = False
        self._stepped_since_zero = False
        if set_to_none:
            self._grad_since_zero = False
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
    def grad_since_zero(self) -> bool:
        """A grad arrived since the last ``zero_grad(set_to_none=True)``."""
        return self._grad_since_zero

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
