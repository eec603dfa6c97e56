"""One step's protocol: from the first grad after a step to the step that consumes it.

A :class:`StepRound` holds what the scaler / clip / step protocol builds up over one step: the
global stats (grad_stats.GradStats, from the one all-reduce), the norm per norm type (raw, and
as handed out: averaged and, once known, unscaled), the inverse scale and the clips. It resolves
the step's grad coefficient ``avg * inv_scale * clip`` on the device.

It is handed what it needs (the averaging factor, the stats, the norms) and holds no reference
to the optimizer, nor calls into it. After the step it stays readable as the
LAST round: ``grad_norm()`` after ``step`` reads its norms without a collective.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

from torch import Tensor

from .. import norms
from .grad_stats import GradStats


class StepRound:
    def __init__(self, avg_factor: float, avg_tensor: Tensor) -> None:
        self.avg_factor = avg_factor
        self.avg_tensor = avg_tensor  # 0-d device tensor holding avg_factor (no per-step H2D)
        self.stats: Optional[GradStats] = None
        self.raw_norms: Dict[float, Tensor] = {}  # before averaging and unscaling
        self.norms: Dict[float, Tensor] = {}  # handed out; unscaled in place when the scale is known
        self.inv_scale: Optional[Tensor] = None
        self.clips: List[Tuple[Any, Tensor]] = []
        # clips whose norm is a handed-out norm, unscaled in place later (opt.clip_grad_norm before
        # unscaling: loop G); torch's clip functions hand in a norm that stays as it was
        self.clips_following_scale = 0
        self.cache_after_step = True  # False (capturable): graph replays rewrite the raw norms
        self.lrs: Optional[Any] = None  # hparams.TensorLrs: this step's tensor lrs, read once with the stats

    # ------------------------------------------------------------ stats
    def set_stats(self, stats: GradStats) -> None:
        """The step's global stats (the first norm type's all-reduce)."""
        self.stats = stats
        self.raw_norms[stats.norm_type] = stats.raw_norm

    def add_norm_type(self, norm_type: float, raw_norm: Tensor) -> None:
        """A second norm type in one step: its global norm, before averaging and unscaling (the
        caller reduced its partial: norms.py)."""
        self.raw_norms[norm_type] = raw_norm

    def first_norm_type(self) -> float:
        return next(iter(self.raw_norms), 2.0)

    # ------------------------------------------------------------ norms, unscale, clips
    def norm(self, norm_type: float) -> Tensor:
        """The norm as handed out: averaged, unscaled as far as the scale is known (the SAME
        tensor is divided in place by ``unscale``)."""
        norm = self.norms.get(norm_type)
        if norm is None:
            norm = self._derived(norm_type)
            self.norms[norm_type] = norm
        return norm

    def norm_after_step(self, norm_type: float) -> Tensor:
        """After the step consumed this round: the unscaled norm that step used, no collective (a
        norm type it computed: the step cycle's gate, ``Action.NORM``, refuses another)."""
        norm = self.norms.get(norm_type)  # handed out during the step, unscaled by it
        if norm is None:
            norm = self._derived(norm_type)
            if self.cache_after_step:
                self.norms[norm_type] = norm
        return norm

    def _derived(self, norm_type: float) -> Tensor:
        # a new tensor in every case: ``unscale`` multiplies a handed-out norm in place
        raw = self.raw_norms[norm_type]
        if self.inv_scale is None:
            return raw * self.avg_factor
        return raw * self.inv_scale if self.avg_factor == 1.0 else raw * self.avg_factor * self.inv_scale

    def add_clip(self, max_norm: "float | Tensor", norm: Tensor) -> None:
        """Clip to ``max_norm`` (a number, or a 0-d device tensor: never read here) given ``norm``
        (resolved at the step, so a handed-out norm divided by the scale in place before then is
        compared unscaled: loop G)."""
        self.clips.append((max_norm if isinstance(max_norm, Tensor) else float(max_norm), norm))
        if self.inv_scale is None and any(norm is n for n in self.norms.values()):
            self.clips_following_scale += 1

    def unscale(self, inv: Tensor) -> None:
        """The scale is known: norms handed out become the true norms, in place."""
        for norm in self.norms.values():
            norm.mul_(inv)
        self.inv_scale = inv

    def coef_parts(self) -> Tuple[Tensor, float, Optional[Tensor], float]:
        """``(base, scale, norm, max_norm)``: the step's grad coefficient is ``base * scale *
        clip_coef(max_norm, norm)`` (no clip when ``norm`` is None), formed on the device in
        one launch with the step counts (``kernels.step_scalars``). Several clips are folded
        into ``base`` here (``coef``)."""
        if len(self.clips) > 1 or (self.clips and isinstance(self.clips[0][0], Tensor)):
            return self.coef(), 1.0, None, 0.0  # several clips, or a device max_norm: folded here
        if self.inv_scale is not None:
            base, scale = self.inv_scale, self.avg_factor
        else:
            base, scale = self.avg_tensor, 1.0
        if not self.clips:
            return base, scale, None, 0.0
        max_norm, norm = self.clips[0]
        return base, scale, norm, max_norm

    def coef(self) -> Tensor:
        """``avg * inv_scale * clip``: the one device scalar the step kernel multiplies grads by."""
        coef = self.avg_tensor
        if self.inv_scale is not None:
            coef = self.inv_scale if self.avg_factor == 1.0 else self.inv_scale * self.avg_factor
        clip = norms.chained_clip_coef(self.clips)
        return coef if clip is None else coef * clip

    def done(self) -> None:
        """The step consumed this round: keep only what ``norm_after_step`` reads."""
        self.stats = None
        self.clips, self.clips_following_scale = [], 0
