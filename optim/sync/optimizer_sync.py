"""The communication half of ``DistributedFusedAdam``'s public API: ``grad_sync``,
``param_sync``, ``attach`` and ``no_sync``.

:class:`OptimizerSync` is a base of ``DistributedFusedAdam`` (distributed_fused_adam.py), as
reads.py's ``OptimizerReads`` is: each method hands the work to the part that owns it (the
grads' reduction to grad_sync.py, the params' all-gather to param_sync.py, the forward's guard
to stale_read_guard.py). It keeps no state of its own.
"""
from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch

from .stale_read_guard import StaleReadGuard


class OptimizerSync:
    """The communication half of ``DistributedFusedAdam``'s public API (see that class)."""

    # what DistributedFusedAdam builds, used here
    _grad_sync: Any
    _param_sync: Any

    def grad_sync(self) -> None:
        """Finish reducing the grads: launch the buckets not yet launched, wait for all."""
        self._grad_sync.sync()

    def param_sync(self) -> None:
        """Wait for the params' all-gather (only ever pending with ``overlap_param_sync``)."""
        self._param_sync.wait()

    def attach(self, model: torch.nn.Module) -> StaleReadGuard:
        """With ``overlap_param_sync``: make every param read during ``model``'s forward current,
        also where no module hook sees it (the root's forward body reading a child's weight, a
        helper, a borrowed weight), and land all in-flight all-gathers when the forward returns.
        Returns a handle whose ``remove()`` detaches. Without ``overlap_param_sync`` nothing is
        ever in flight after ``step`` and this changes nothing."""
        return StaleReadGuard(self._param_sync, model)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """As DDP's ``no_sync``: backward inside accumulates grads locally; the first backward
        outside reduces everything accumulated."""
        with self._grad_sync.no_sync():
            yield
