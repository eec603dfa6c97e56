"""What a DistributedFusedAdam answers besides stepping: the grads as torch would hold them,
the step's health, its state dicts and memory.

:class:`OptimizerReads` is a base of ``DistributedFusedAdam`` (distributed_fused_adam.py), the
public methods that read the optimizer without training it, each handing the work to the part that
owns it: the grads to grads_view.py, the health to step/health.py, the state dicts to
checkpoint/state_dict.py. It keeps no state of its own.
"""
from __future__ import annotations

import math
from typing import Any, Dict, List, Optional, Tuple

import torch
from torch import Tensor

from . import kernels
from .checkpoint import state_dict as _state_dict
from .grads_view import LocalGrad
from .shards.buffers import memory_stats
from .shards.view import ShardView


class OptimizerReads:
    """The reading half of ``DistributedFusedAdam``'s public API (see that class)."""

    # what DistributedFusedAdam builds, read here
    _grads_view: Any
    _health: Any
    _cycle: Any
    _skip_above: float
    _shard_view: ShardView
    _buffers: List[Any]
    _grad_sync: Any
    _buckets: List[Any]
    _device: torch.device

    # ------------------------------------------------------------------ the grads (grads_view.py)
    def full_grad(self, p: torch.nn.Parameter) -> Optional[Tensor]:
        """What ``p.grad`` would hold in the same unsharded torch loop at this point, on every rank
        (as DeepSpeed's ``safe_get_full_grad``).

        A COLLECTIVE: every rank calls it, for the same param, at the same point (every rank's
        arrival through the store first, bounded: a rank alone raises after half of
        ``SHARDAMP_COLLECTIVE_TIMEOUT``, 30 s unset, issuing no collective, so the others train
        on; an agreement all-reduce checks the param; then a MAX all-reduce, the reduction of any pending grads
        (``grad_sync``) and an all-gather over the shard dim of at most ``min(p.numel(), shard
        size)`` elements per rank). SYNCS THE HOST (it reads whether any rank produced a grad).

        Args:
            p: a param of this optimizer.

        Returns:
            A new tensor with ``p``'s shape, dtype and strides (its memory order: a channels_last
            weight's grad is channels_last), holding the reduced grad averaged over the ranks as
            ``average_grad_sync`` says; still multiplied by the loss scale before ``unscale_``
            (ShardedGradScaler's or torch.amp.GradScaler's), unscaled after; times the coefficients
            of the clips recorded so far; after ``step`` (until ``zero_grad``) the grads times the
            coefficient that step used. ``None`` when no rank produced a grad for ``p`` since
            ``zero_grad(set_to_none=True)``, as ``p.grad`` in torch.

        Raises:
            ValueError: ``p`` is not a param of this optimizer.
            RuntimeError: called inside ``no_sync()``, where the accumulated grads are not reduced
                (call it after the backward that reduces, or call ``grad_sync()`` on every rank
                outside ``no_sync`` first); or the ranks did not all call it for the same param
                (on some ranks only: read ``local_grad(p)`` for rank-local logging).
        """
        return self._grads_view.full_grad(p)

    def local_grad(self, p: torch.nn.Parameter) -> Optional[LocalGrad]:
        """This rank's slice of ``p``'s reduced grad. NOT a collective; no host sync.

        Args:
            p: a param of this optimizer.

        Returns:
            ``LocalGrad(tensor, start, end)``: ``tensor`` (1-D, ``p``'s dtype, a new tensor) holds
            elements ``[start, end)`` of ``full_grad(p)`` in ``p``'s memory order (the order of
            ``torch.empty_like(p)``'s storage), with the same values (averaged, scaled before
            ``unscale_``, clipped as recorded so far). ``None`` where this rank's shard holds
            none of ``p``, or when this optimizer holds no grads (no backward since
            ``zero_grad(set_to_none=True)``) on this rank.

        Raises:
            ValueError: ``p`` is not a param of this optimizer.
            RuntimeError: called inside ``no_sync()``, or while this rank holds grads not reduced
                yet (``overlap_grad_sync=False`` before ``step``, or after a ``no_sync`` backward):
                call ``grad_sync()`` on every rank first.
        """
        return self._grads_view.local_grad(p)

    # ------------------------------------------------------------------ step health (step/health.py)
    @property
    def skip_grad_norm_above(self) -> Optional[float]:
        """The constructor's ``skip_grad_norm_above`` (None: no step is skipped for its norm)."""
        return None if math.isinf(self._skip_above) else self._skip_above

    def last_nonfinite(self) -> List[Tuple[int, str]]:
        """Where the last step's gradients overflowed: the sorted ``(rank, param_name)`` pairs
        whose gradient held an inf or NaN on that rank BEFORE the reduction.

        ``rank`` is the global rank; ``param_name`` the name given with ``named_parameters()``,
        else ``"group {g}, param {i}, shape (...)"`` (``i`` counted within the group). Empty for
        a step that was not skipped for non-finite grads (a finite step, a spike), and empty when
        the inf/NaN arose only in the reduction (an fp16 sum overflowing), the norm, or an
        invalid loss scale: ``step_stats()["skipped_nonfinite"]`` (or the scaler's found-inf)
        counted the step but this list is empty.

        Returns:
            list of ``(int, str)``, the same on every rank.

        Collective / host sync: none where the report is ready, which it is once the step's
        flags have been read on the host (at once on the CPU; on CUDA from the next step's
        first ``unscale_``/``clip_grad_norm``/``grad_norm``/``step`` on; after a step a
        ``_step_supports_amp_scaling = False`` scaler skipped): the ranks' flags were then
        all-gathered there. Asked earlier (CUDA right after ``step``; CUDA graphs, whose replays
        read nothing back; world 1 with a scaler), it reads the device (a host sync) and, if
        some rank's own grads held inf/NaN in a skipped step, all-gathers the ranks' flags: a
        collective, so then call it on every rank.
        """
        return self._health.last_nonfinite()

    def last_step_skipped(self) -> Tensor:
        """Whether the last ``step`` was skipped (non-finite grads or norm, or a norm above
        ``skip_grad_norm_above``), as the step kernels decided on the device.

        Returns:
            A new 0-d float32 tensor on the params' device, exactly 1.0 (skipped) or 0.0, the same
            on every rank; 0.0 before the first step. A scaler that skipped ``step`` on the host
            (``_step_supports_amp_scaling = False``) is not counted here: ask the scaler.

        Neither a collective nor a host sync (``bool()`` of it is one).
        """
        return self._health.skip.clone()

    def grad_norms_by_group(self) -> Tensor:
        """Each param group's global grad norm, from the step's one stats all-reduce.

        Returns:
            1-D float32 tensor on the params' device, one entry per param group: unscaled (as
            far as the scale is known, as :meth:`grad_norm`), before clipping, averaged as the
            grads are, in the norm type of the step's stats (2 unless the first norm asked for
            the step was another, e.g. ``clip_grad_norm(norm_type=inf)``). After ``step`` (and
            ``zero_grad``): that step's norms, until the next stats.

        Collective: before the step's stats exist (after backward, before any norm, unscale or
        step) this computes them: the step's one all-reduce, so every rank calls it then.
        Never reads a value on the host.

        Raises:
            RuntimeError: no step and no backward yet (nothing to report).
        """
        if self._cycle.last_step() is not None:
            return self._health.group_norms(True, self._avg_factor, None)
        self._ensure_stats(self._current_round().first_norm_type())
        return self._health.group_norms(False, self._avg_factor, self._cycle.inv_scale)

    def step_stats(self) -> Dict[str, Any]:
        """Counters of the steps so far, every key always present:

        * ``steps``: updates applied; ``skipped_steps``: ``skipped_spike + skipped_nonfinite``;
        * ``skipped_spike``: skipped for a norm above ``skip_grad_norm_above``;
        * ``skipped_nonfinite``: skipped for inf/NaN grads, a non-finite norm or loss scale (also
          skips the device made on invalid values or ranks that disagree, which raise);
        * ``consecutive_skips``: skipped steps in a row up to the last one;
        * ``last_grad_norm``: the last step's global norm (unscaled, before clipping, the step's
          norm type; inf/NaN for an overflow), None before the first step;
        * ``loss_scale``: the scale of the scaler driving this optimizer after its last update
          (ShardedGradScaler, or torch.amp.GradScaler handing itself to ``step``), None without one.

        Returns:
            dict of int / float / None.

        Host sync: ONE host read of the device counters (and the scale), when called; nothing
        is read per step. Not a collective (the counters are the same on every rank).
        """
        return self._health.stats()

    # ------------------------------------------------------------------ state (checkpoint/state_dict.py)
    def state_dict(self, *, rank0_only: bool = False, cpu_offload: bool = True) -> Optional[Dict[str, Any]]:
        """The optimizer's full state, world-size independent, in ``torch.optim.AdamW``'s layout.

        ``state[i]`` holds ``step``, ``exp_avg`` and ``exp_avg_sq`` shaped like param ``i``
        (plus ``master_param`` where the model dtype differs from the state dtype), and
        ``param_groups`` uses torch's keys, so the dict loads into ``torch.optim.AdamW`` / ``Adam``
        and into a DistributedFusedAdam at any world size and bucket size. A blockwise moment
        (``"8bit"`` / ``"4bit"``) is kept as its codes and block scales (flat uint8 codes plus
        ``*_scales``, ``*_block_offset`` and ``param_layout`` entries): pass the dict through
        ``shardamp.optim.to_torch_state_dict`` for torch.

        A collective: every rank of the process group calls it, at the same point. It starts
        with one small all-reduce that checks the ranks are in the same call with the same
        arguments (and that the last step clipped alike on every rank), then gathers each
        bucket's shards (an all-gather, or a gather to rank 0 with ``rank0_only``). It waits
        for pending param all-gathers, and syncs the host: the step counts and, with
        ``cpu_offload``, every tensor are copied to the CPU.

        Args:
            rank0_only: only the group's rank 0 receives the dict; the others get ``None`` and
                never hold more than one bucket's gather buffer.
            cpu_offload: return CPU tensors (default); ``False`` keeps them on the params'
                device.

        Returns:
            The state dict, or ``None`` on the ranks other than 0 with ``rank0_only``.

        Raises:
            RuntimeError: the ranks called different collectives, or the others never joined
                (after ``SHARDAMP_COLLECTIVE_TIMEOUT`` on gloo, else the group's timeout), or the
                last step clipped on some ranks only; nothing is read.
            ValueError: the ranks passed different arguments.
        """
        return _state_dict.gather_state_dict(self, rank0_only=rank0_only, cpu_offload=cpu_offload)

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Load a full state dict (ours, or ``torch.optim.AdamW`` / ``Adam``'s over the same
        params) into this rank's shard, at any world size and bucket layout.

        Master params come from ``master_param`` entries when present, otherwise from the
        model's current params: load the model's weights first (``load_state_dict(assign=False)``,
        so they land in the optimizer's buffers). Params without a state entry restart from step 0
        with zero moments, as in torch. Moments are converted to their storage dtype (fp32 into
        bf16 moments rounds to nearest even).

        A collective: every rank calls it with the same dict. Everything is validated on every
        rank before anything is written, and one small all-reduce carries the verdict and a
        summary of each rank's dict, so a problem on any rank raises on every rank and leaves
        every optimizer untouched. Validation reads the dict's values on the host (a host sync
        when the dict holds device tensors).

        Args:
            state_dict: the full dict every rank loads.

        Raises:
            ValueError: the dict is malformed, does not fit the params (count, shapes), holds
                invalid values (negative ``exp_avg_sq``, a NaN lr, meta tensors), or the ranks
                were given different dicts; nothing is written.
            RuntimeError: the ranks called different collectives, or the others never joined.
        """
        _state_dict.load_state_dict(self, state_dict)

    def shard_view(self) -> ShardView:
        """This rank's shard and layout, for state-dict and checkpoint code (shard_view.py)."""
        return self._shard_view

    def memory_stats(self) -> Dict[str, int]:
        """Bytes this rank's optimizer holds, by kind (model params excluded): ``master`` (0
        where the master IS the param shard, 2 B/element as int16 remainders), ``moments``
        (exp_avg + exp_avg_sq as their format stores them, ``StateFormat.nbytes``: 4 B/element
        each in fp32, 2 in bf16; a blockwise format's codes plus one fp32 scale per block,
        exactly as allocated),
        ``grad_shards`` (reduced grads; at one process on the CPU, grads the step reads where
        autograd left them count here too), ``grad_buckets`` (full-size bucket buffers alive now:
        with ``capturable`` all of them, else at most the ones in flight), ``param_sync`` (the
        lower-precision all-gather buffers), and ``total`` (these kinds: the params' device);
        then what ``offload="cpu"`` keeps in host memory: ``host_master``, ``host_moments``
        (the offloaded buckets' state, which ``master`` and ``moments`` then leave out),
        ``host_copies`` (their grad and param copy buffers) and ``host_total`` (all 0 without
        offload). Local; no host sync."""
        return memory_stats(self._buffers, self._grad_sync.alive_full_buffers())

    def __repr__(self) -> str:
        lines = [
            f"{type(self).__name__} (",
            f"  world_size={self.world_size}, rank={self.rank}, buckets={len(self._buckets)}, "
            f"adam_w_mode={self.adam_w_mode}, max_grad_norm={self.max_grad_norm}, dtype={self.dtype}, "
            f"capturable={self.capturable}, skip_grad_norm_above={self.skip_grad_norm_above}, "
            f"kernels={kernels.backend(self._device)}",
        ]
        for i, group in enumerate(self.param_groups):
            keys = ", ".join(f"{k}={group[k]}" for k in sorted(group) if k not in ("params", "param_names"))
            lines.append(f"  group {i}: {len(group['params'])} params, {keys}")
        lines.append(")")
        return "\n".join(lines)
