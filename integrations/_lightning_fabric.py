"""The Fabric strategy's logic, for ``lightning.fabric`` and ``lightning_fabric`` alike: a mixin
each package's module combines with that package's Fabric ``DDPStrategy``
(``shardamp.integrations.lightning`` / ``shardamp.integrations.lightning_fabric``). Imports no
Lightning package.
"""
from __future__ import annotations

import contextlib
import re
from datetime import timedelta
from typing import Any, Dict, Iterator, List, Optional, Union

import torch
from torch.distributed.constants import default_pg_timeout

from shardamp.optim import DistributedFusedAdam, clip_grad_norm_

from . import _lightning_common as common
from . import _sharded_checkpoint as shards

_STATE_KEY = re.compile(r"^[A-Za-z0-9_.-]+$")


class _NoBackwardSync:
    """``fabric.no_backward_sync(model)``: the DistributedFusedAdams holding the model's params
    keep their grads local (``opt.no_sync()``) until the first backward outside."""

    def __init__(self, strategy: "FabricStrategyMixin") -> None:
        self._strategy = strategy  # not a weakref: the strategy is pickled to spawned processes

    def no_backward_sync(self, module: torch.nn.Module, enabled: bool) -> contextlib.AbstractContextManager:
        if not enabled:
            return contextlib.nullcontext()
        held = {id(p) for p in module.parameters()}
        opts = [opt for opt in self._strategy.set_up_optimizers()
                if any(id(p) in held for group in opt.param_groups for p in group["params"])]
        if not opts:
            raise ValueError(
                "fabric.no_backward_sync(module): no DistributedFusedAdam set up through this Fabric holds the "
                "module's parameters. Set the optimizer up first (fabric.setup(model, optimizer) or "
                "fabric.setup_optimizers(optimizer))."
            )
        return _entered(opts)


@contextlib.contextmanager
def _entered(opts: List[DistributedFusedAdam]) -> Iterator[None]:
    with contextlib.ExitStack() as stack:
        for opt in opts:
            stack.enter_context(opt.no_sync())
        yield


class _OptimizerLoader:
    """Stands in for a DistributedFusedAdam in the state Fabric's ``load_checkpoint`` restores,
    so that a shard reference is loaded from the shards and a full state dict as usual."""

    def __init__(self, strategy: "FabricStrategyMixin", opt: DistributedFusedAdam, path: Any) -> None:
        self.strategy, self.opt, self.path = strategy, opt, path

    def state_dict(self) -> Dict[str, Any]:  # Fabric's _Stateful protocol asks for it
        return {}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        if shards.is_reference(state):
            shards.load(self.opt, shards.resolve(state, self.path), self.strategy, self.strategy.staging_dir)
        else:
            self.opt.load_state_dict(state)


class FabricStrategyMixin(common.StrategyBase):
    """ShardampFabricStrategy's logic: Fabric's ``DDPStrategy`` (launchers, process group,
    distributed sampler) without the DDP wrapper, for ``DistributedFusedAdam``. Combined with a
    package's Fabric ``DDPStrategy`` by ``shardamp.integrations.lightning`` and
    ``shardamp.integrations.lightning_fabric``, whose class statement names that package's
    precision plugins (``precisions=``, run as they are); see their ``ShardampFabricStrategy``."""

    def __init__(
        self,
        accelerator: Optional[Any] = None,
        parallel_devices: Optional[List[torch.device]] = None,
        cluster_environment: Optional[Any] = None,
        checkpoint_io: Optional[Any] = None,
        precision: Optional[Any] = None,
        process_group_backend: Optional[str] = None,
        timeout: Optional[timedelta] = default_pg_timeout,
        start_method: str = "popen",
        sharded_checkpoint: bool = False,
        staging_dir: Optional[str] = None,
        **kwargs: Any,
    ) -> None:
        """``accelerator``, ``parallel_devices``, ``cluster_environment``, ``checkpoint_io``,
        ``precision``, ``process_group_backend`` and ``timeout`` are as Fabric's ``DDPStrategy``'s
        (usually left to ``Fabric(accelerator=, devices=, precision=, plugins=)``).

        Args:
            start_method: ``"popen"``, ``"spawn"``, ``"fork"`` or ``"forkserver"`` (the
                registered ``shardamp_spawn``, ``shardamp_fork``, ``shardamp_notebook``).
            sharded_checkpoint: ``fabric.save(path, state)`` writes each DistributedFusedAdam in
                ``state`` (under key ``k``) as per-rank shards into ``<path>.<k>/`` and stores that
                directory's name (relative to ``path``) in its place
                (``strategy="shardamp_sharded_checkpoint"``). Default: every rank takes part in
                the optimizer's collective ``state_dict``, rank 0 writes it into the file.
                ``fabric.load`` reads either format.
            staging_dir: with ``sharded_checkpoint`` and a non-local fsspec path: where rank 0
                stages the shards before uploading them; every rank must see it. Default: the
                temp dir.

        Raises:
            ValueError: DDP-only options, an unknown ``start_method``, or a precision plugin
                DistributedFusedAdam cannot train with.
        """
        super().__init__(
            start_method, sharded_checkpoint, staging_dir, kwargs, accelerator=accelerator,
            parallel_devices=parallel_devices, cluster_environment=cluster_environment, checkpoint_io=checkpoint_io,
            precision=precision, process_group_backend=process_group_backend, timeout=timeout,
        )
        self._backward_sync_control = _NoBackwardSync(self)
        self._set_up: List[DistributedFusedAdam] = []  # by setup_optimizer, for no_backward_sync

    precision = common.precision_property(
        "_precision", "The precision plugin; 16-mixed's GradScaler is a ShardedGradScaler.")

    # ------------------------------------------------------------------ set up, no DDP
    def setup_module(self, module: torch.nn.Module) -> torch.nn.Module:
        """The module itself (no DDP wrapper), every rank starting from rank 0's buffers. Build
        the DistributedFusedAdam after the module is on its device and dtype (``fabric.setup``
        moves it; ``fabric.init_module()`` builds it there)."""
        common.broadcast_buffers(module)
        return module

    def set_up_optimizers(self) -> List[DistributedFusedAdam]:
        """The DistributedFusedAdams set up through this strategy, in setup order."""
        return list(self._set_up)

    def setup_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """The optimizer itself; it must be a DistributedFusedAdam.

        Raises:
            ValueError: any other optimizer (nothing would reduce its grads).
        """
        opt = common.require_fused_adam(optimizer, f"{type(self).__name__}: fabric.setup",
                                        "Build a DistributedFusedAdam, or use strategy='ddp' for other optimizers.")
        if not any(known is opt for known in self._set_up):
            self._set_up.append(opt)
        return optimizer

    # ------------------------------------------------------------------ clipping
    def clip_gradients_norm(
        self,
        module: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        max_norm: Union[float, int],
        norm_type: Union[float, int] = 2.0,
        error_if_nonfinite: bool = True,
    ) -> torch.Tensor:
        """``fabric.clip_gradients(model, optimizer, max_norm=...)``: unscale (16-mixed; no pass
        over the grads) and clip through ``shardamp.optim.clip_grad_norm_``, i.e. inside the
        optimizer's step kernel with the true global norm.

        Returns:
            The global norm before clipping, a 0-d tensor on the params' device (not read on the
            host).

        ``error_if_nonfinite`` (Fabric's default True) does not raise here: the norm stays on the
        device, and a step whose norm (or any grad) is not finite is skipped on every rank, as
        ShardedGradScaler skips an fp16 overflow (params and moments untouched; without a scaler
        the optimizer warns after three skipped steps in a row). Check ``torch.isfinite(norm)``
        to stop on it.
        """
        opt = common.unwrap(optimizer)
        if not isinstance(opt, DistributedFusedAdam):
            return super().clip_gradients_norm(module, optimizer, max_norm, norm_type, error_if_nonfinite)
        scaler = getattr(self.precision, "scaler", None)
        if scaler is not None:
            scaler.unscale_(opt)
        return clip_grad_norm_(self.precision.main_params(opt), max_norm, norm_type)

    def clip_gradients_value(self, module: torch.nn.Module, optimizer: torch.optim.Optimizer,
                             clip_val: Union[float, int]) -> None:
        """Raises ValueError for a DistributedFusedAdam: its grads live in reduce-scattered shards."""
        if isinstance(common.unwrap(optimizer), DistributedFusedAdam):
            raise ValueError(
                "fabric.clip_gradients(clip_val=...) with DistributedFusedAdam: its grads live in reduce-scattered "
                "shards (param.grad is None), so they cannot be clipped by value. Use max_norm=... instead."
            )
        return super().clip_gradients_value(module, optimizer, clip_val)

    # ------------------------------------------------------------------ checkpoints
    def get_optimizer_state(self, optimizer: torch.optim.Optimizer) -> Dict[str, Any]:
        """The optimizer's collective state dict, called on every rank (``fabric.save``,
        ``optimizer.state_dict()``): whole on rank 0, ``{}`` elsewhere."""
        opt = common.unwrap(optimizer)
        if not isinstance(opt, DistributedFusedAdam):
            return super().get_optimizer_state(optimizer)
        state = opt.state_dict(rank0_only=True)
        return state if state is not None else {}

    def save_checkpoint(self, path: Any, state: Dict[str, Any], storage_options: Optional[Any] = None,
                        filter: Optional[Dict[str, Any]] = None) -> None:
        """Every rank: with ``sharded_checkpoint`` each DistributedFusedAdam's shards first, then
        Fabric's save (rank 0 writes the file). ``path`` may be an fsspec URL.

        Raises:
            ValueError: a state key that cannot name a directory, or a ``filter`` on a sharded
                optimizer.
        """
        if self.sharded_checkpoint:
            state = dict(state)
            for key, obj in state.items():
                if not isinstance(obj, DistributedFusedAdam):
                    continue
                if not _STATE_KEY.match(key):
                    raise ValueError(f"fabric.save: state key {key!r} names the directory of its optimizer shards "
                                     "(<path>.<key>); use letters, digits, '_', '-' or '.'")
                if filter and key in filter:
                    raise ValueError(f"fabric.save: filter[{key!r}] cannot filter a sharded optimizer's state; "
                                     "remove it or use sharded_checkpoint=False")
                state[key] = shards.save(obj, path, f".{key}", self, self.staging_dir)
        super().save_checkpoint(path, state, storage_options=storage_options, filter=filter)

    def load_checkpoint(self, path: Any, state: Optional[Any] = None, strict: bool = True,
                        weights_only: Optional[bool] = None) -> Dict[str, Any]:
        """Fabric's, with each DistributedFusedAdam loaded on every rank from the file or from
        the shards it refers to (beside ``path``)."""
        if isinstance(state, DistributedFusedAdam):  # fabric.load_raw(path, optimizer)
            _OptimizerLoader(self, state, path).load_state_dict(
                self.checkpoint_io.load_checkpoint(path, weights_only=weights_only))
            return {}
        if not isinstance(state, dict) or not any(isinstance(o, DistributedFusedAdam) for o in state.values()):
            return super().load_checkpoint(path, state, strict=strict, weights_only=weights_only)
        proxied = {k: _OptimizerLoader(self, o, path) if isinstance(o, DistributedFusedAdam) else o
                   for k, o in state.items()}
        remainder = super().load_checkpoint(path, proxied, strict=strict, weights_only=weights_only)
        for k, o in proxied.items():  # Fabric hands metadata back through this dict
            if not isinstance(o, _OptimizerLoader):
                state[k] = o
        return remainder
