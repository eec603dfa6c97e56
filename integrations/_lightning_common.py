"""What shardamp's Lightning strategies share, whatever the package they plug into (``lightning``,
``pytorch_lightning``, ``lightning_fabric``): the optimizer check, the precision routing, the
strategy options and the registry entries, and ``StrategyBase``, the part of both strategies'
constructors and classes that is the same for the Trainer and Fabric. Imports no Lightning
package: each package's module (``lightning.py``, ``pytorch_lightning.py``,
``lightning_fabric.py``) hands its own classes in.
"""
from __future__ import annotations

import warnings
from typing import Any, ClassVar, Dict, Iterable, Mapping, Optional, Sequence, Tuple

import torch

from shardamp.optim import DistributedFusedAdam
from shardamp.scaler import ShardedGradScaler

START_METHODS = ("popen", "spawn", "fork", "forkserver")
PRECISIONS = "'32-true', 'bf16-mixed', '16-mixed', 'bf16-true' or '16-true'"
# what a package's Precision, HalfPrecision and MixedPrecision plugins are to route_precision
PRECISION_KINDS = ("plain", "half", "mixed")

# (name, description, init params): Trainer(strategy=name) / Fabric(strategy=name). The start
# methods follow DDP's names ('ddp', 'ddp_spawn', 'ddp_fork', 'ddp_notebook').
VARIANTS: Tuple[Tuple[str, str, Dict[str, Any]], ...] = (
    ("shardamp", "shardamp ZeRO-2 (DistributedFusedAdam, no DDP wrapper), start_method='popen'",
     {"start_method": "popen"}),
    ("shardamp_spawn", "shardamp ZeRO-2, start_method='spawn'", {"start_method": "spawn"}),
    ("shardamp_fork", "shardamp ZeRO-2, start_method='fork'", {"start_method": "fork"}),
    ("shardamp_notebook", "shardamp ZeRO-2, start_method='fork' (notebooks)", {"start_method": "fork"}),
    ("shardamp_sharded_checkpoint",
     "shardamp ZeRO-2, each rank writes its optimizer shard beside the checkpoint file (DCP)",
     {"start_method": "popen", "sharded_checkpoint": True}),
)


def unwrap(optimizer: Any) -> Any:
    """The optimizer behind Lightning's ``LightningOptimizer`` (``_optimizer``), Fabric's
    ``_FabricOptimizer`` (``optimizer``) or itself."""
    inner = getattr(optimizer, "_optimizer", None)
    return inner if inner is not None else optimizer


def require_fused_adam(optimizer: Any, who: str, fix: str) -> DistributedFusedAdam:
    """``optimizer`` (unwrapped) if it is a DistributedFusedAdam, else ValueError: without DDP
    nothing else would reduce the grads."""
    opt = unwrap(optimizer)
    if not isinstance(opt, DistributedFusedAdam):
        raise ValueError(
            f"{who}: {type(opt).__name__} is not a DistributedFusedAdam; the strategy does not wrap the model in "
            f"DDP, so only shardamp.optim.DistributedFusedAdam reduces the grads. {fix}"
        )
    return opt


def check_options(who: str, start_method: str, kwargs: Mapping[str, Any]) -> None:
    """Reject DDP-only keyword arguments and unknown start methods, naming the fix."""
    if kwargs:
        raise ValueError(
            f"{who}: unexpected arguments {sorted(kwargs)}. DDP's options (find_unused_parameters, static_graph, "
            "ddp_comm_hook, ...) do not apply: the model is not wrapped in DDP. Remove them."
        )
    if start_method not in START_METHODS:
        raise ValueError(f"{who}: start_method={start_method!r}; expected one of {', '.join(START_METHODS)}")
    if start_method == "fork" and "fork" not in torch.multiprocessing.get_all_start_methods():
        raise ValueError(f"{who}: start_method='fork' is not supported on this platform; use 'spawn' "
                         "(strategy='shardamp_spawn') or 'popen' (strategy='shardamp')")


def broadcast_buffers(module: torch.nn.Module) -> None:
    """Start every rank from rank 0's buffers, as DDP's constructor does (the optimizer
    broadcasts the params itself); unlike DDP's default they are not re-broadcast every forward."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        for buf in module.buffers():
            torch.distributed.broadcast(buf, src=0)


def sharded_scaler(scaler: Optional[torch.amp.GradScaler], device: str) -> Optional[ShardedGradScaler]:
    """A ShardedGradScaler with ``scaler``'s settings (``scaler`` itself if it is one already)."""
    if scaler is None or isinstance(scaler, ShardedGradScaler):
        return scaler
    return ShardedGradScaler(
        device, init_scale=scaler.get_scale(), growth_factor=scaler.get_growth_factor(),
        backoff_factor=scaler.get_backoff_factor(), growth_interval=scaler.get_growth_interval(),
        enabled=scaler.is_enabled(),
    )


def route_precision(plugin: Any, table: Mapping[type, Tuple[str, type]], who: str) -> Any:
    """The precision plugin the strategy runs with instead of ``plugin``.

    ``table`` maps a package's plugin class to ``(kind, replacement class)``, kind being
    ``"plain"``, ``"half"`` or ``"mixed"``; a mixed plugin's torch GradScaler becomes a
    ShardedGradScaler with the same settings (every rank skips the same steps). Plugins already
    routed (this package's with ``_shardamp`` set, or the replacement class itself with a sharded
    scaler) come back unchanged. Anything else raises ValueError naming the precisions that work."""
    if plugin is None or (getattr(plugin, "_shardamp", False) and isinstance(plugin, tuple(table))):
        return plugin
    entry = table.get(type(plugin))
    if entry is None:
        raise ValueError(
            f"{who}: precision plugin {type(plugin).__name__} is not supported (DistributedFusedAdam keeps fp32, "
            f"bf16 or fp16 params and clips inside its step); use precision={PRECISIONS}."
        )
    kind, replacement = entry
    if kind == "mixed":
        scaler = sharded_scaler(plugin.scaler, plugin.device)
        if type(plugin) is replacement and scaler is plugin.scaler:
            return plugin
        return replacement(plugin.precision, plugin.device, scaler)
    if type(plugin) is replacement:
        return plugin
    return replacement(plugin.precision) if kind == "half" else replacement()


def register(cls: type, registry: Any, variants: Iterable[Tuple[str, str, Dict[str, Any]]]) -> None:
    """Register ``cls`` under each variant's name in a Lightning strategy registry.

    A name already registered to this same class (the module imported again, or reloaded) is
    re-registered; a name another package registered is left alone, with a warning naming how to
    reach the strategy anyway (``strategy=cls(...)``)."""
    for name, description, params in variants:
        override = False
        if name in registry:
            taken = dict.__getitem__(registry, name)["strategy"]
            override = (getattr(taken, "__module__", None), getattr(taken, "__qualname__", None)) == (
                cls.__module__, cls.__qualname__)
            if not override:
                warnings.warn(
                    f"strategy name {name!r} is already registered to {getattr(taken, '__qualname__', taken)}; "
                    f"{cls.__module__}.{cls.__qualname__} is not registered under it. Pass "
                    f"strategy={cls.__qualname__}({', '.join(f'{k}={v!r}' for k, v in params.items())}) instead.",
                    UserWarning, stacklevel=3,
                )
                continue
        registry.register(name, cls, description=description, override=override, **params)


def precision_table(plugins: Sequence[type],
                    replacements: Optional[Sequence[type]] = None) -> Dict[type, Tuple[str, type]]:
    """``route_precision``'s table from a package's ``(Precision, HalfPrecision, MixedPrecision)``
    and the classes run instead of each (default: the same classes)."""
    return {plugin: (kind, replacement)
            for kind, plugin, replacement in zip(PRECISION_KINDS, plugins, replacements or plugins)}


def precision_property(attribute: str, doc: str) -> property:
    """A strategy's precision plugin kept in ``attribute``: routed (``route_precision`` over the
    class's ``_precision_table``) when set, the class's ``_plain_precision()`` while unset."""

    def get(self: Any) -> Any:
        plugin = getattr(self, attribute)
        return plugin if plugin is not None else self._plain_precision()

    def set_(self: Any, plugin: Optional[Any]) -> None:
        setattr(self, attribute, route_precision(plugin, self._precision_table, type(self).__name__))

    return property(get, set_, doc=doc)


class StrategyBase:
    """What ShardampStrategy (Trainer) and ShardampFabricStrategy share between their own mixin
    (``_lightning_trainer.TrainerStrategyMixin``, ``_lightning_fabric.FabricStrategyMixin``) and
    their package's ``DDPStrategy``: the options checked before DDP's constructor runs and kept
    after it, the registered names, and the precision table.

    A package's strategy class names its precision plugins in its class statement,
    ``precisions=(Precision, HalfPrecision, MixedPrecision)``, with ``replacements=`` the classes
    run instead of each where they differ (default: the same classes)."""

    # the package's precision plugin class -> ("plain" | "half" | "mixed", the class run instead)
    _precision_table: ClassVar[Mapping[type, Tuple[str, type]]] = {}
    _plain_precision: ClassVar[type]  # what runs without a precision plugin

    def __init_subclass__(cls, precisions: Optional[Sequence[type]] = None,
                          replacements: Optional[Sequence[type]] = None, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if precisions is not None:
            cls._precision_table = precision_table(precisions, replacements)
            cls._plain_precision = (replacements or precisions)[0]

    def __init__(self, start_method: str, sharded_checkpoint: bool, staging_dir: Optional[str],
                 unexpected: Mapping[str, Any], **ddp_kwargs: Any) -> None:
        """Refuse ``unexpected`` (DDP-only) arguments and unknown start methods, run the
        package's ``DDPStrategy`` constructor with ``start_method`` and ``ddp_kwargs``, keep the
        checkpoint options."""
        check_options(type(self).__name__, start_method, unexpected)
        super().__init__(start_method=start_method, **ddp_kwargs)
        self.sharded_checkpoint = bool(sharded_checkpoint)
        self.staging_dir = staging_dir

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        """Register ``shardamp``, ``shardamp_spawn``, ``shardamp_fork``, ``shardamp_notebook``
        and ``shardamp_sharded_checkpoint`` in the package's ``strategy_registry`` (done on
        import)."""
        register(cls, strategy_registry, VARIANTS)
