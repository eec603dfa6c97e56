"""In-process checks of the Lightning integration (no process group, no spawn): the strategy
names registered on import in all four registries (lightning.pytorch, pytorch_lightning,
lightning.fabric, lightning_fabric), the options reachable through them, precision routing,
LightningCLI's selection from YAML, imports with one package missing, errors, and the sharded
checkpoint format's own parts (relative names, fsspec URLs, the completion marker last) at world 1.
Training through these strategies is checked against torch in test_lightning.py."""
from __future__ import annotations

import importlib
import os
import pickle
import subprocess
import sys
import textwrap
from datetime import timedelta

import pytest
import torch

pytest.importorskip("lightning")

import framework_ref as ref  # noqa: E402

NAMES = ["shardamp", "shardamp_spawn", "shardamp_fork", "shardamp_notebook", "shardamp_sharded_checkpoint"]
TRAINERS = {  # Trainer package -> (its strategies module, the shardamp module registering there)
    "lightning.pytorch": ("lightning.pytorch.strategies", "shardamp.integrations.lightning"),
    "pytorch_lightning": ("pytorch_lightning.strategies", "shardamp.integrations.pytorch_lightning"),
}
FABRICS = {
    "lightning.fabric": ("lightning.fabric.strategies", "shardamp.integrations.lightning"),
    "lightning_fabric": ("lightning_fabric.strategies", "shardamp.integrations.lightning_fabric"),
}


def _need(pkg: str) -> None:
    """Skip where a standalone package (pytorch_lightning, lightning_fabric) is not installed."""
    pytest.importorskip(pkg.split(".")[0])


def _trainer_registry(pkg: str):
    _need(pkg)
    strategies, integration = TRAINERS[pkg]
    return importlib.import_module(strategies).StrategyRegistry, importlib.import_module(integration).ShardampStrategy


def _fabric_registry(pkg: str):
    _need(pkg)
    strategies, integration = FABRICS[pkg]
    return importlib.import_module(strategies).STRATEGY_REGISTRY, importlib.import_module(integration).ShardampFabricStrategy


def _trainer(pkg: str, **kwargs):
    _need(pkg)
    pl = importlib.import_module(pkg)
    importlib.import_module(TRAINERS[pkg][1])
    return pl.Trainer(accelerator="cpu", devices=2, logger=False, enable_progress_bar=False,
                      enable_model_summary=False, enable_checkpointing=False, **kwargs)


def _fabric(pkg: str, **kwargs):
    _need(pkg)
    fabric_cls = importlib.import_module(pkg).Fabric
    importlib.import_module(FABRICS[pkg][1])
    return fabric_cls(accelerator="cpu", devices=2, **kwargs)


# ---------------------------------------------------------------------- the registries
@pytest.mark.parametrize("pkg", list(TRAINERS) + list(FABRICS))
def test_import_registers_every_name_with_its_options(pkg) -> None:
    registry, cls = _trainer_registry(pkg) if pkg in TRAINERS else _fabric_registry(pkg)
    base = importlib.import_module(TRAINERS[pkg][0] if pkg in TRAINERS else FABRICS[pkg][0]).DDPStrategy
    assert issubclass(cls, base)  # that package's class hierarchy, as its Trainer / Fabric checks
    for name in NAMES:
        entry = registry[name]
        assert entry["strategy"] is cls and entry["description"].startswith("shardamp"), entry
    start = {name: registry.get(name)._start_method for name in NAMES}
    assert start == {"shardamp": "popen", "shardamp_spawn": "spawn", "shardamp_fork": "fork",
                     "shardamp_notebook": "fork", "shardamp_sharded_checkpoint": "popen"}
    assert [registry.get(name).sharded_checkpoint for name in NAMES] == [False] * 4 + [True]


def test_the_two_trainer_packages_get_their_own_classes() -> None:
    (reg_a, a), (reg_b, b) = _trainer_registry("lightning.pytorch"), _trainer_registry("pytorch_lightning")
    assert a is not b and reg_a is not reg_b
    assert a.__module__ == "shardamp.integrations.lightning" and b.__module__ == "shardamp.integrations.pytorch_lightning"
    assert not issubclass(a, importlib.import_module("pytorch_lightning.strategies").DDPStrategy)
    # one source of logic: every method the strategy overrides comes from the same mixin
    assert a.__mro__[1] is b.__mro__[1] and a.__mro__[1].__module__ == "shardamp.integrations._lightning_trainer"


def test_reimport_keeps_the_names_and_another_owner_is_left_alone() -> None:
    import shardamp.integrations.lightning as integration
    from lightning.fabric.strategies.registry import _StrategyRegistry
    from lightning.pytorch.strategies import StrategyRegistry

    reloaded = importlib.reload(integration)  # registering again (same class) must not raise
    assert StrategyRegistry["shardamp"]["strategy"] is reloaded.ShardampStrategy
    assert isinstance(StrategyRegistry.get("shardamp"), reloaded.ShardampStrategy)

    class Other:
        pass

    registry = _StrategyRegistry()
    registry.register("shardamp", Other, description="someone else's")
    with pytest.warns(UserWarning, match="'shardamp' is already registered to .*Other.*ShardampStrategy"):
        reloaded.ShardampStrategy.register_strategies(registry)
    assert registry["shardamp"]["strategy"] is Other  # not taken over
    assert registry["shardamp_spawn"]["strategy"] is reloaded.ShardampStrategy


# ---------------------------------------------------------------------- Trainer / Fabric by name
@pytest.mark.parametrize("pkg", list(TRAINERS))
def test_trainer_strategy_by_name_routes_every_precision(pkg) -> None:
    from shardamp.scaler import ShardedGradScaler

    _need(pkg)
    integration = importlib.import_module(TRAINERS[pkg][1])
    routed = {"32-true": "ShardampPrecision", "bf16-mixed": "ShardampMixedPrecision",
              "bf16-true": "ShardampHalfPrecision", "16-true": "ShardampHalfPrecision"}
    for precision, plugin in routed.items():
        trainer = _trainer(pkg, strategy="shardamp", precision=precision)
        assert type(trainer.strategy) is integration.ShardampStrategy
        assert type(trainer.precision_plugin) is getattr(integration, plugin), precision
        assert type(trainer.precision_plugin).__module__ == integration.__name__
        assert getattr(trainer.precision_plugin, "scaler", None) is None
    mixed = importlib.import_module(f"{pkg}.plugins.precision").MixedPrecision
    trainer = _trainer(pkg, strategy="shardamp_spawn",
                       plugins=[mixed("16-mixed", "cpu", torch.amp.GradScaler("cpu", init_scale=2.0 ** 10,
                                                                               growth_interval=7))])
    scaler = trainer.precision_plugin.scaler
    assert type(scaler) is ShardedGradScaler and trainer.strategy._start_method == "spawn"
    assert (scaler.get_scale(), scaler.get_growth_interval()) == (2.0 ** 10, 7)  # the user's settings kept
    with pytest.raises(ValueError, match=r"DoublePrecision is not supported.*precision='32-true'"):
        _trainer(pkg, strategy="shardamp", precision="64-true")


@pytest.mark.parametrize("pkg", list(FABRICS))
def test_fabric_strategy_by_name_routes_every_precision(pkg) -> None:
    from shardamp.scaler import ShardedGradScaler

    _need(pkg)
    integration = importlib.import_module(FABRICS[pkg][1])
    precisions = importlib.import_module(f"{pkg}.plugins.precision")
    for precision, plugin in {"32-true": "Precision", "bf16-mixed": "MixedPrecision", "bf16-true": "HalfPrecision"}.items():
        fabric = _fabric(pkg, strategy="shardamp", precision=precision)
        assert type(fabric.strategy) is integration.ShardampFabricStrategy
        assert type(fabric.strategy.precision) is getattr(precisions, plugin), precision
    fabric = _fabric(pkg, strategy="shardamp_sharded_checkpoint",
                     plugins=[precisions.MixedPrecision("16-mixed", "cpu", torch.amp.GradScaler("cpu", init_scale=8.0))])
    scaler = fabric.strategy.precision.scaler
    assert type(scaler) is ShardedGradScaler and scaler.get_scale() == 8.0 and fabric.strategy.sharded_checkpoint
    assert fabric.strategy._backward_sync_control is not None  # fabric.no_backward_sync is supported
    with pytest.raises(ValueError, match=r"DoublePrecision is not supported.*precision='32-true'"):
        _fabric(pkg, strategy="shardamp", precision="64-true")


@pytest.mark.parametrize("cls_name", ["lightning.ShardampStrategy", "pytorch_lightning.ShardampStrategy",
                                      "lightning.ShardampFabricStrategy", "lightning_fabric.ShardampFabricStrategy"])
def test_options_and_errors_name_the_argument(cls_name) -> None:
    module, name = cls_name.split(".")
    _need(module)
    cls = getattr(importlib.import_module(f"shardamp.integrations.{module}"), name)
    strategy = cls(sharded_checkpoint=True, start_method="spawn", timeout=timedelta(seconds=42), staging_dir="/x",
                   process_group_backend="gloo")
    assert (strategy.sharded_checkpoint, strategy._start_method, strategy._timeout, strategy.staging_dir,
            strategy.process_group_backend) == (True, "spawn", timedelta(seconds=42), "/x", "gloo")
    with pytest.raises(ValueError, match=r"unexpected arguments \['find_unused_parameters'\].*Remove them"):
        cls(find_unused_parameters=True)
    with pytest.raises(ValueError, match=r"start_method='thread'; expected one of popen, spawn, fork, forkserver"):
        cls(start_method="thread")


@pytest.mark.parametrize("pkg", list(TRAINERS) + list(FABRICS))
def test_spawn_variants_pickle_with_their_routed_precision(pkg) -> None:
    """start_method='spawn' pickles the strategy (with its precision plugin and scaler) into the
    new processes."""
    _need(pkg)
    precisions = importlib.import_module(f"{pkg}.plugins.precision")
    plugins = [precisions.MixedPrecision("16-mixed", "cpu")]
    if pkg in TRAINERS:
        strategy = _trainer(pkg, strategy="shardamp_spawn", plugins=plugins).strategy
        scaler = strategy.precision_plugin.scaler
    else:
        strategy = _fabric(pkg, strategy="shardamp_spawn", plugins=plugins).strategy
        scaler = strategy.precision.scaler
    copy = pickle.loads(pickle.dumps(strategy))
    assert type(copy) is type(strategy) and copy._start_method == "spawn"
    copied = copy.precision_plugin.scaler if pkg in TRAINERS else copy.precision.scaler
    assert type(copied) is type(scaler) and copied.get_scale() == scaler.get_scale()


def test_fabric_refuses_other_optimizers_and_clipping_by_value() -> None:
    from shardamp.integrations.lightning import ShardampFabricStrategy
    from shardamp.optim import DistributedFusedAdam

    strategy = ShardampFabricStrategy()
    model = ref.make_model()
    with pytest.raises(ValueError, match=r"fabric.setup: AdamW is not a DistributedFusedAdam.*use strategy='ddp'"):
        strategy.setup_optimizer(torch.optim.AdamW(model.parameters()))
    opt = DistributedFusedAdam(model.parameters())  # world 1, no process group
    assert strategy.setup_optimizer(opt) is opt
    with pytest.raises(ValueError, match=r"clip_val=.*Use max_norm"):
        strategy.clip_gradients_value(model, opt, 1.0)
    with pytest.raises(ValueError, match="no DistributedFusedAdam set up through this Fabric holds"):
        strategy._backward_sync_control.no_backward_sync(ref.make_model(), enabled=True)
    with strategy._backward_sync_control.no_backward_sync(model, enabled=True):  # this one's params: fine
        pass


# ---------------------------------------------------------------------- LightningCLI
@pytest.mark.parametrize("pkg", list(TRAINERS))
@pytest.mark.parametrize("form", ["name", "class_path"])
def test_lightning_cli_selects_the_strategy_from_yaml(pkg, form, tmp_path, monkeypatch) -> None:
    pytest.importorskip("jsonargparse")
    _need(pkg)
    monkeypatch.setattr(sys, "argv", ["train.py"])  # the config comes through args=
    import cases_lightning

    pl = importlib.import_module(pkg)
    cli_module = importlib.import_module(f"{pkg}.cli")
    integration = importlib.import_module(TRAINERS[pkg][1])
    if form == "name":
        strategy = "  strategy: shardamp_sharded_checkpoint\n"
    else:
        strategy = textwrap.indent(textwrap.dedent(f"""\
            strategy:
              class_path: {integration.__name__}.ShardampStrategy
              init_args:
                sharded_checkpoint: true
                start_method: spawn
                staging_dir: {tmp_path}
            """), "  ")
    config = tmp_path / "config.yaml"
    config.write_text("trainer:\n" + strategy + "  accelerator: cpu\n  devices: 2\n  logger: false\n"
                      f"  default_root_dir: {tmp_path}\n")
    cli = cli_module.LightningCLI(cases_lightning.make_module_class(pl), run=False, args=["--config", str(config)],
                                  save_config_callback=None, seed_everything_default=False)
    assert type(cli.trainer.strategy) is integration.ShardampStrategy
    assert cli.trainer.strategy.sharded_checkpoint is True
    if form == "class_path":
        assert cli.trainer.strategy._start_method == "spawn" and cli.trainer.strategy.staging_dir == str(tmp_path)


# ---------------------------------------------------------------------- one package installed
_ONLY = """
import sys
for blocked in {blocked!r}:
    sys.modules[blocked] = None  # as if not installed: importing it raises ImportError
{body}
"""


@pytest.mark.parametrize("blocked, works, fails, fix", [
    (["lightning"], ["pytorch_lightning", "lightning_fabric"], "lightning", "shardamp.integrations.pytorch_lightning"),
    (["pytorch_lightning", "lightning_fabric"], ["lightning"], "pytorch_lightning", "shardamp.integrations.lightning"),
])
def test_each_module_imports_with_only_its_package(blocked, works, fails, fix) -> None:
    for pkg in ("pytorch_lightning", "lightning_fabric"):  # both installed, one blocked at a time
        _need(pkg)
    body = textwrap.dedent(f"""
        import importlib
        for name in {works!r}:
            importlib.import_module("shardamp.integrations." + name)
        from shardamp.integrations import _lightning_common  # the shared logic imports no Lightning package
        try:
            importlib.import_module("shardamp.integrations.{fails}")
        except ImportError as exc:
            print("IMPORT-ERROR:", exc)
        print("LOADED:", sorted(m for m, mod in sys.modules.items() if mod is not None and "." not in m
                                and m in ("lightning", "pytorch_lightning", "lightning_fabric")))
        """)
    if "lightning" in works:
        body += "from lightning.pytorch.strategies import StrategyRegistry; print('REGISTERED:', 'shardamp' in StrategyRegistry)\n"
    else:
        body += "from pytorch_lightning.strategies import StrategyRegistry; print('REGISTERED:', 'shardamp' in StrategyRegistry)\n"
    out = subprocess.run([sys.executable, "-c", _ONLY.format(blocked=blocked, body=body)], capture_output=True,
                         text=True, timeout=300, env={**os.environ, "PYTHONWARNINGS": "ignore"})
    assert out.returncode == 0, out.stderr[-3000:]
    lines = dict(line.split(": ", 1) for line in out.stdout.splitlines() if ": " in line)
    assert "REGISTERED" in lines and lines["REGISTERED"] == "True", out.stdout
    assert fix in lines["IMPORT-ERROR"], lines  # the message names the module to use instead
    assert not set(eval(lines["LOADED"])) & set(blocked), lines


# ---------------------------------------------------------------------- the sharded format, world 1
class _OneRank:
    """The strategies' collective helpers at world 1."""

    is_global_zero = True

    def broadcast(self, obj, src=0):
        return obj

    def reduce_boolean_decision(self, decision, all=True):
        return decision


def _trained_optimizer(steps: int, seed: int = 0):
    from shardamp.optim import DistributedFusedAdam

    model = ref.make_model(seed)
    opt = DistributedFusedAdam(ref.decay_groups(model), lr=ref.LR, betas=ref.BETAS, eps=ref.EPS, bucket_cap_mb=0.0004)
    x, y = ref.dataset(4 * steps, seed=seed + 1)
    for s in range(steps):
        ref.loss_fn(model(x[4 * s:4 * s + 4]), y[4 * s:4 * s + 4]).backward()
        opt.step()
        opt.zero_grad()
    return opt


def _assert_same_state(a, b) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa["param_groups"] == sb["param_groups"] and sorted(sa["state"]) == sorted(sb["state"])
    for i in sa["state"]:
        for key, value in sa["state"][i].items():
            torch.testing.assert_close(sb["state"][i][key], value, rtol=0, atol=0)


def test_sharded_checkpoint_through_a_memory_url_marker_last() -> None:
    from fsspec.implementations.memory import MemoryFileSystem

    from shardamp.integrations import _sharded_checkpoint as shards
    from shardamp.optim.checkpoint import atomic_publish  # where save_sharded's module finds it, before and after optim/ moved into sub-packages

    assert shards.MARKER == atomic_publish.MARKER  # the name the core writes last
    fs = MemoryFileSystem()
    if fs.exists("/shardamp_test"):
        fs.rm("/shardamp_test", recursive=True)
    saved = _trained_optimizer(3)
    puts = []
    original_put = MemoryFileSystem.put_file
    MemoryFileSystem.put_file = lambda self, lpath, rpath, **kw: (puts.append(rpath), original_put(self, lpath, rpath, **kw))[1]
    try:
        entry = shards.save(saved, "memory://shardamp_test/run/last.ckpt", ".optim0", _OneRank())
        shards.save(saved, "memory://shardamp_test/run/last.ckpt", ".optim0", _OneRank())  # over an existing one
    finally:
        MemoryFileSystem.put_file = original_put
    assert entry == {shards.DCP_KEY: "last.ckpt.optim0"}
    first = puts[:len(puts) // 2]
    assert os.path.basename(first[-1]) == shards.MARKER and sum(os.path.basename(p) == shards.MARKER for p in first) == 1
    assert any(os.path.basename(p) == ".metadata" for p in first)
    assert fs.exists("/shardamp_test/run/last.ckpt.optim0/" + shards.MARKER)

    location = shards.resolve(entry, "memory://shardamp_test/run/last.ckpt")
    assert location == "memory:///shardamp_test/run/last.ckpt.optim0"
    loaded = _trained_optimizer(1, seed=5)  # other state, same shapes
    shards.load(loaded, location, _OneRank())
    _assert_same_state(saved, loaded)

    fs.rm("/shardamp_test/run/last.ckpt.optim0/" + shards.MARKER)  # an upload that did not finish
    with pytest.raises(ValueError, match="holds no complete sharded optimizer checkpoint"):
        shards.load(loaded, location, _OneRank())
    shards.remove("memory://shardamp_test/run/last.ckpt", ".optim0")
    assert not fs.exists("/shardamp_test/run/last.ckpt.optim0")
    with pytest.raises(ValueError, match="no sharded optimizer checkpoint at memory:///shardamp_test"):
        shards.load(loaded, location, _OneRank())


def test_resolving_names_old_absolute_paths_and_moved_checkpoints(tmp_path) -> None:
    from shardamp.integrations import _sharded_checkpoint as shards

    ckpt = tmp_path / "new" / "step=2.ckpt"
    (tmp_path / "new" / "step=2.ckpt.optim0").mkdir(parents=True)
    (tmp_path / "old").mkdir()
    key = shards.DCP_KEY
    assert shards.resolve({key: "step=2.ckpt.optim0"}, ckpt) == str(tmp_path / "new" / "step=2.ckpt.optim0")
    assert shards.resolve({key: "step=2.ckpt.optim0"}, f"file://{ckpt}") == str(tmp_path / "new" / "step=2.ckpt.optim0")
    # the format before: an absolute path, used while it exists ...
    assert shards.resolve({key: str(tmp_path / "old")}, ckpt) == str(tmp_path / "old")
    # ... and, once gone, the directory of that name beside the checkpoint (the checkpoints moved)
    gone = tmp_path / "elsewhere" / "step=2.ckpt.optim0"
    assert shards.resolve({key: str(gone)}, ckpt) == str(tmp_path / "new" / "step=2.ckpt.optim0")
    assert shards.resolve({key: str(tmp_path / "nowhere" / "x")}, ckpt) == str(tmp_path / "nowhere" / "x")
    for bad in ("../step=2.ckpt.optim0", "a/b", ""):
        with pytest.raises(ValueError, match="is not the name of a directory beside the checkpoint file"):
            shards.resolve({key: bad}, ckpt)


def test_old_absolute_path_loads_through_the_trainer_strategy(tmp_path) -> None:
    """The Trainer strategy's load path at world 1: a checkpoint in the format before (an
    absolute path) and one in this format (a name), without and with load_checkpoint."""
    from shardamp.integrations import _sharded_checkpoint as shards
    from shardamp.integrations.lightning import ShardampStrategy

    saved = _trained_optimizer(2)
    entry = shards.save(saved, tmp_path / "a.ckpt", ".optim0", _OneRank())
    strategy = ShardampStrategy()
    loaded = _trained_optimizer(1, seed=3)
    strategy.optimizers = [loaded]
    strategy.load_optimizer_state_dict({"optimizer_states": [{shards.DCP_KEY: str(tmp_path / "a.ckpt.optim0")}]})
    _assert_same_state(saved, loaded)
    with pytest.raises(ValueError, match=r"refers to optimizer shards by name.*strategy.load_checkpoint"):
        strategy.load_optimizer_state_dict({"optimizer_states": [entry]})
    torch.save({"optimizer_states": [entry]}, tmp_path / "a.ckpt")
    loaded = _trained_optimizer(1, seed=4)
    strategy.optimizers = [loaded]
    strategy.load_optimizer_state_dict(strategy.load_checkpoint(tmp_path / "a.ckpt"))
    _assert_same_state(saved, loaded)
