"""The worker of benchmarks/bench_frameworks.py: one framework's default route and its shardamp
route, trained in that framework's own loop, in one process.

bench_frameworks.py starts ``python benchmarks/bench_frameworks.py --worker NAME ...`` once per
framework, which lands in :func:`worker`: for each (model, precision) it runs ``--repeats``
pairs, default and shardamp alternating (the order flips every repeat: AB BA AB ...), each run
with a fresh model, optimizer and trainer / accelerator, and times iterations
``(warmup, warmup + iters]`` with :class:`BlockTimer`. The results go to a JSON file, rewritten
after every run, so that a worker stopped midway still leaves what it measured.

Under ``--nproc N`` the worker runs as N ranks of one torch.distributed.run job: every rank runs
the same runs on its own device and micro-batch, rank 0 times and writes them. The models and
their data are in framework_models.py.

Routes (at world 1 on one device; at world N each framework's DDP against the same shardamp route):

* lightning: ``Trainer(strategy="auto")`` (one device: ``SingleDeviceStrategy``) +
  ``torch.optim.AdamW(fused=True)`` against ``Trainer(strategy="shardamp")`` +
  ``DistributedFusedAdam``; no clipping on either (``gradient_clip_val``'s default; Lightning
  refuses to clip a fused optimizer under AMP anyway);
* accelerate: ``Accelerator`` + ``AdamW(fused=True)`` against ``ShardampAccelerator`` +
  ``DistributedFusedAdam``, both in accelerate's documented loop (``backward``,
  ``clip_grad_norm_(1.0)``, ``step``, ``zero_grad``);
* transformers: ``Trainer`` with ``optim="adamw_torch_fused"`` against ``ShardampTrainer``
  (``ShardampTrainerMixin`` over ``Trainer``), both with the default ``max_grad_norm=1.0``.

On the CPU torch's AdamW is the non-fused one (as in the examples).
"""
from __future__ import annotations

import gc
import json
import math
import os
import shutil
import statistics
import sys
import tempfile
import time
import traceback
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parents[1] / "examples"))  # framework_common.py
import framework_common as common  # noqa: E402  (the examples' MLP, its loss, decay groups, AdamW settings)
from framework_models import Workload, workload  # noqa: E402
from framework_profile import KINDS, BlockProfile, python_diff  # noqa: E402
from host_iteration import sync  # noqa: E402

FRAMEWORKS = ("lightning", "accelerate", "transformers")
ROUTES = ("default", "shardamp")
PRECISIONS = ("bf16", "fp16")
LR = 1e-4  # lower than the examples' 1e-3: GPT-2 in fp16 would overflow more at that rate
MAX_GRAD_NORM = 1.0  # the Trainer's default; the accelerate loop clips at the same value
# what each framework needs imported, the integration included (a framework that is not
# installed is skipped with a line)
IMPORTS = {"lightning": ("lightning.pytorch", "shardamp.integrations.lightning"),
           "accelerate": ("accelerate", "shardamp.integrations.accelerate"),
           "transformers": ("transformers", "shardamp.integrations.transformers")}


@dataclass
class Setting:
    """What every run of a worker shares."""

    device: torch.device
    small: bool
    warmup: int
    iters: int
    world: int = 1  # processes under torchrun (--nproc): each trains work.batch per step on its own device
    rank: int = 0

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    @property
    def steps(self) -> int:
        return self.warmup + self.iters

    @property
    def samples(self) -> int:
        """Rows of one run's data: ``steps`` micro-batches for every rank (each framework's
        distributed sampler gives each rank its share)."""
        return self.steps * self.world


def make_optimizer(route: str, model: torch.nn.Module, cuda: bool) -> torch.optim.Optimizer:
    """The Lightning and accelerate routes' optimizer (the Trainer builds its own from its args)."""
    from shardamp.optim import DistributedFusedAdam

    groups = common.decay_groups(model)
    kw = dict(lr=LR, betas=common.BETAS, eps=common.EPS)
    if route == "shardamp":
        return DistributedFusedAdam(groups, **kw)
    return torch.optim.AdamW(groups, fused=cuda, **kw)


def describe_wrapper(model: torch.nn.Module) -> str:
    """Whether the framework wrapped the model for data parallelism (at world 1 it should not)."""
    wrappers = (torch.nn.parallel.DistributedDataParallel, torch.nn.DataParallel)
    return f"model in {type(model).__name__}" if isinstance(model, wrappers) else "no DDP wrapper"


def describe_optimizer(opt: Any) -> str:
    while hasattr(opt, "optimizer") and isinstance(getattr(opt, "optimizer"), torch.optim.Optimizer):
        opt = opt.optimizer  # accelerate's AcceleratedOptimizer, Lightning's LightningOptimizer
    fused = isinstance(opt, torch.optim.Optimizer) and opt.defaults.get("fused")
    return type(opt).__name__ + ("(fused=True)" if fused else "")


# ------------------------------------------------------------------------------ timing
class BlockTimer:
    """Milliseconds per iteration over iterations ``(warmup, warmup + iters]``, the device
    synchronized at both ends. Python's cyclic collector runs just before the block and is off
    inside it, as in host_iteration.interleaved: a full collection over a heap of three
    frameworks' objects lands in whichever repeat triggers it and scatters that one.

    Each iteration's own time too, without a sync inside the block: on CUDA an event recorded at
    each step's end (the GPU's clock: when its work for that step was done), on the CPU the
    host's clock. Their median (``median_ms``) ignores the few iterations a run loses to
    something else on the machine, which the block's mean takes in whole."""

    def __init__(self, device: torch.device, warmup: int, iters: int, profile: Optional[BlockProfile] = None) -> None:
        self.device, self.warmup, self.iters = device, warmup, iters
        self.profile = profile  # bench_frameworks --profile: records the block instead of timing it
        self.t0: Optional[float] = None
        self.t1: Optional[float] = None
        self.loss: Optional[float] = None
        self.marks: List[Any] = []  # CUDA events or perf_counter seconds, from the block's start

    def _mark(self) -> None:
        if self.device.type == "cuda":
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.marks.append(event)
        else:
            self.marks.append(time.perf_counter())

    def step_done(self, step: int, loss: Optional[torch.Tensor] = None) -> None:
        """``step`` optimizer steps have finished; ``loss`` (optional) is read after the block."""
        if step == self.warmup:
            gc.collect()
            sync(self.device)
            gc.disable()
            self.t0 = time.perf_counter()
            self._mark()
            if self.profile is not None:
                self.profile.start()
        elif self.warmup < step <= self.warmup + self.iters:
            self._mark()
            if step == self.warmup + self.iters:
                sync(self.device)
                self.t1 = time.perf_counter()
                if self.profile is not None:
                    self.profile.stop(self.iters)
                gc.enable()
                if loss is not None:
                    self.loss = float(loss.detach())

    @property
    def iter_ms(self) -> List[float]:
        """Each timed iteration's milliseconds (after the block; empty before it ended)."""
        if self.t1 is None or len(self.marks) != self.iters + 1:
            return []
        if self.device.type == "cuda":
            return [a.elapsed_time(b) for a, b in zip(self.marks, self.marks[1:])]
        return [(b - a) * 1e3 for a, b in zip(self.marks, self.marks[1:])]

    @property
    def median_ms(self) -> float:
        times = self.iter_ms
        return statistics.median(times) if times else math.nan

    @property
    def ms(self) -> float:
        if self.t0 is None or self.t1 is None:
            return math.nan
        return (self.t1 - self.t0) * 1e3 / self.iters


def _loss_scale(scaler: Any) -> Optional[float]:
    """fp16 only: the scaler's scale after the run (below 65536: it skipped steps on overflow)."""
    if scaler is None or not getattr(scaler, "is_enabled", lambda: False)():
        return None
    return float(scaler.get_scale())


# ------------------------------------------------------------------------------ the three loops
def run_lightning(route: str, work: Workload, s: Setting, precision: str, timer: BlockTimer) -> Dict[str, Any]:
    import lightning.pytorch as pl

    import shardamp.integrations.lightning  # noqa: F401  (registers strategy="shardamp")

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = work.model(s.device)

        def training_step(self, batch: Dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
            return self.net(**batch)["loss"]

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return make_optimizer(route, self.net, s.cuda)

    wrapped: List[str] = []  # the strategy's model while it trains (teardown unwraps DDP)

    class Timer(pl.Callback):
        def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            if not wrapped:
                wrapped.append(describe_wrapper(trainer.strategy.model))
            timer.step_done(batch_idx + 1, outputs["loss"])  # one micro-batch per optimizer step

    trainer = pl.Trainer(
        strategy="shardamp" if route == "shardamp" else "auto", accelerator="gpu" if s.cuda else "cpu", devices=s.world,
        precision={"bf16": "bf16-mixed", "fp16": "16-mixed"}[precision], max_steps=s.steps, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, callbacks=[Timer()],
    )
    module = Module()
    trainer.fit(module, DataLoader(work.dataset(s.samples), batch_size=work.batch, shuffle=False))
    return {"resolved": f"Trainer(strategy={type(trainer.strategy).__name__}), "
                        f"{describe_optimizer(trainer.optimizers[0])}, {wrapped[0]}",
            "loss_scale": _loss_scale(getattr(trainer.precision_plugin, "scaler", None))}


def run_accelerate(route: str, work: Workload, s: Setting, precision: str, timer: BlockTimer) -> Dict[str, Any]:
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState

    from shardamp.integrations.accelerate import ShardampAccelerator

    AcceleratorState._reset_state(True)  # accelerate keeps one configuration per process
    GradientState._reset_state()
    cls = ShardampAccelerator if route == "shardamp" else Accelerator
    acc = cls(mixed_precision=precision, cpu=not s.cuda)
    model = work.model(acc.device)
    opt = make_optimizer(route, model, s.cuda)
    loader = DataLoader(work.dataset(s.samples), batch_size=work.batch, shuffle=False)
    model, opt, loader = acc.prepare(model, opt, loader)
    steps = 0
    for batch in loader:
        loss = model(**batch)["loss"]
        acc.backward(loss)
        acc.clip_grad_norm_(model.parameters(), MAX_GRAD_NORM)
        opt.step()
        opt.zero_grad()
        steps += 1
        timer.step_done(steps, loss)
        if steps == s.steps:
            break
    return {"resolved": f"{cls.__name__} (distributed_type {acc.distributed_type.value}, {describe_wrapper(model)}), "
                        f"{describe_optimizer(opt)}, clip_grad_norm_({MAX_GRAD_NORM})",
            "loss_scale": _loss_scale(acc.scaler)}


def run_transformers(route: str, work: Workload, s: Setting, precision: str, timer: BlockTimer) -> Dict[str, Any]:
    from accelerate.state import AcceleratorState, GradientState
    from transformers import PrinterCallback, Trainer, TrainerCallback, TrainingArguments

    from shardamp.integrations.transformers import ShardampTrainer

    class Timer(TrainerCallback):
        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            timer.step_done(state.global_step)

    AcceleratorState._reset_state(True)  # the Trainer's accelerator: one configuration per process
    GradientState._reset_state()
    with tempfile.TemporaryDirectory() as out:
        targs = TrainingArguments(
            output_dir=out, per_device_train_batch_size=work.batch, max_steps=s.steps, learning_rate=LR,
            adam_beta1=common.BETAS[0], adam_beta2=common.BETAS[1], adam_epsilon=common.EPS,
            weight_decay=common.WD, max_grad_norm=MAX_GRAD_NORM, bf16=precision == "bf16", fp16=precision == "fp16",
            optim="adamw_torch_fused" if s.cuda else "adamw_torch", use_cpu=not s.cuda, report_to="none",
            save_strategy="no", disable_tqdm=True, seed=0,
            # the Trainer's DDP would otherwise search the graph for unused params every step
            # (its default for any model without gradient checkpointing); Lightning's and
            # accelerate's DDP do not, and the comparison is with DDP at its fastest
            ddp_find_unused_parameters=False,
        )
        cls = ShardampTrainer if route == "shardamp" else Trainer
        trainer = cls(model=work.model(s.device), args=targs, train_dataset=work.dataset(s.samples), callbacks=[Timer()])
        trainer.remove_callback(PrinterCallback)  # disable_tqdm's stand-in prints the final metrics: log noise
        result = trainer.train()
    return {"resolved": f"{cls.__name__}(optim={getattr(targs.optim, 'value', targs.optim)}, "
                        f"max_grad_norm={MAX_GRAD_NORM}): {describe_optimizer(trainer.optimizer)}, "
                        f"{describe_wrapper(trainer.model_wrapped)}",
            "mean_loss": float(result.training_loss),
            "loss_scale": _loss_scale(getattr(trainer.accelerator, "scaler", None))}


RUNNERS = {"lightning": run_lightning, "accelerate": run_accelerate, "transformers": run_transformers}


def one_run(framework: str, route: str, work: Workload, s: Setting, precision: str,
            profile: Optional[BlockProfile] = None) -> Dict[str, Any]:
    """One fresh model, optimizer and trainer, trained ``s.steps`` iterations: ms per iteration
    of the timed block and the peak bytes allocated above what was allocated before it
    (``profile``: the block recorded into it, its times not a measurement)."""
    env = dict(os.environ)  # Lightning's launcher exports LOCAL_RANK, WORLD_SIZE, ... even at one device
    gc.collect()
    base = 0
    if s.cuda:
        torch.cuda.empty_cache()
        base = torch.cuda.memory_allocated(s.device)
        torch.cuda.reset_peak_memory_stats(s.device)
    timer = BlockTimer(s.device, s.warmup, s.iters, profile)
    try:
        info = RUNNERS[framework](route, work, s, precision, timer)
    finally:
        os.environ.clear()
        os.environ.update(env)
        gc.enable()
    if math.isnan(timer.ms):
        raise RuntimeError(f"{framework} {route}: the run ended before step {s.steps} (warmup + iters)")
    peak = torch.cuda.max_memory_allocated(s.device) - base if s.cuda else None
    return dict(route=route, ms=timer.ms, median_ms=timer.median_ms, iter_ms=[round(t, 3) for t in timer.iter_ms],
                peak_bytes=peak, loss=timer.loss, **info)


# ------------------------------------------------------------------------------ the worker
def _versions() -> Dict[str, str]:
    import importlib

    out = {"torch": torch.__version__}
    for name in ("lightning", "accelerate", "transformers"):
        try:
            out[name] = importlib.import_module(name).__version__
        except ImportError:
            pass
    return out


def _quiet() -> None:
    """Keep the log to the measurements: the frameworks' info lines and the warnings every run
    repeats (a one-process DataLoader, a run shorter than the logging interval)."""
    import logging

    for name in ("lightning.pytorch", "lightning.fabric", "pytorch_lightning", "lightning_fabric"):
        logging.getLogger(name).setLevel(logging.WARNING)
    for pattern in (".*does not have many workers.*", ".*smaller than the logging interval.*"):
        warnings.filterwarnings("ignore", message=pattern)


def _agreed(s: Setting, value: Any) -> Any:
    """Rank 0's ``value`` on every rank (a broadcast; at world 1 the value itself): what each rank
    decides from its own clock (the budget) must be one decision, or the ranks would run
    different configs and wait for each other in their first collective."""
    if s.world == 1:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def worker(framework: str, result_path: str, deadline: Optional[float], models: List[str], precisions: List[str],
           repeats: int, s: Setting, profile: bool = False) -> None:
    """Every (precision, model) of one framework, into ``result_path`` (JSON, written by rank 0).
    At ``s.world`` > 1 every rank of the torchrun job runs this; rank 0 times and reports.
    ``profile``: after a config's pairs, each route's block recorded (framework_profile.py) into
    ``profile/<framework>_<model>_<precision>.txt`` beside ``result_path``."""
    import importlib
    import signal

    # the parent stops a worker with SIGTERM: exit through the finally below (process group, temp dir)
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    result: Dict[str, Any] = dict(framework=framework, status="ok", configs=[], world=s.world)
    lead = s.rank == 0

    def write() -> None:
        if lead:
            Path(result_path).write_text(json.dumps(result, indent=1))

    def say(text: str) -> None:
        if lead:
            print(text, flush=True)

    try:
        for name in IMPORTS[framework]:
            importlib.import_module(name)
    except ImportError as exc:
        result.update(status="skipped", reason=f"not importable ({type(exc).__name__}: {exc})")
        say(f"{framework}: skipped, not importable ({exc})")
        write()
        return
    _quiet()
    from shardamp.optim import kernels

    result.update(versions=_versions(), kernels=kernels.backend(s.device),
                  device_name=torch.cuda.get_device_name(s.device) if s.cuda else "cpu")
    tmp = tempfile.mkdtemp(prefix="shardamp-bench-pg-")
    if s.cuda:
        torch.cuda.set_device(s.device)
    if framework == "lightning" or s.world > 1:
        # strategy="shardamp" is DDPStrategy without DDP: it wants a process group, at world 1 too
        # (one rank, file rendezvous); under torchrun every framework's would be made from the
        # same environment. Made here once: the frameworks reuse it and never destroy it
        init = "env://" if s.world > 1 else f"file://{tmp}/pg"
        dist.init_process_group("nccl" if s.cuda else "gloo", init_method=init, rank=s.rank, world_size=s.world,
                                device_id=s.device if s.cuda else None)
    took: Dict[str, float] = {}  # model -> seconds its last config took: whether the next fits the budget
    try:
        for precision in precisions:
            for model in models:
                config: Dict[str, Any] = dict(model=model, precision=precision, runs=[])
                result["configs"].append(config)
                label = f"{framework} {model} {precision}"
                reason = _agreed(s, _skip_reason(s, model, precision, deadline, took.get(model)))
                if reason:
                    config.update(status="skipped", reason=reason)
                    say(f"{label}: skipped, {reason}")
                    write()
                    continue
                started = time.time()
                try:
                    work = workload(model, s.small)
                    config["params"] = work.params()
                    for r in range(repeats):
                        for route in ROUTES if r % 2 == 0 else ROUTES[::-1]:
                            run = dict(repeat=r, **one_run(framework, route, work, s, precision))
                            config["runs"].append(run)
                            write()  # a worker stopped midway still leaves its finished runs
                            peak = "" if run["peak_bytes"] is None else f", peak {run['peak_bytes'] / 2**30:.2f} GiB"
                            say(f"{label} repeat {r} {route}: {run['ms']:.2f} ms/iter{peak}")
                    if profile:
                        text = profiled(framework, work, s, precision)
                        if lead:
                            where = Path(result_path).parent / "profile"
                            where.mkdir(exist_ok=True)
                            (where / f"{framework}_{model}_{precision}.txt").write_text(text)
                            say(f"{label}: profiled into {where}")
                    config["status"] = "ok"
                except Exception as exc:  # noqa: BLE001 - one config failing must not cost the others
                    config.update(status="error", reason=f"{type(exc).__name__}: {exc}",
                                  traceback=traceback.format_exc()[-4000:])
                    print(f"{label}: ERROR on rank {s.rank}: {type(exc).__name__}: {exc}", flush=True)
                config["seconds"] = took[model] = time.time() - started
                write()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        shutil.rmtree(tmp, ignore_errors=True)


def profiled(framework: str, work: Workload, s: Setting, precision: str) -> str:
    """One run of each route per recording kind (framework_profile.KINDS), as text: each
    recording, then the Python functions whose own time differs most between the routes."""
    recs: Dict[Tuple[str, str], BlockProfile] = {}
    for kind in KINDS:
        for route in ROUTES:
            recs[(route, kind)] = rec = BlockProfile(kind, s.device)
            one_run(framework, route, work, s, precision, rec)
    parts = [f"# {framework} {work.name} {precision}: where the host time goes (recorded runs, not timed)"]
    for (route, kind), rec in recs.items():
        parts += ["", f"## {route}, {kind}"] + rec.lines
    parts += ["", "## python: shardamp against default"] + python_diff(recs[("default", "python")],
                                                                     recs[("shardamp", "python")])
    return "\n".join(parts) + "\n"


def _skip_reason(s: Setting, model: str, precision: str, deadline: Optional[float],
                 last: Optional[float]) -> Optional[str]:
    if precision == "fp16" and not s.cuda:
        # accelerate and the Trainer have no fp16 autocast or scaler on the CPU; Lightning's
        # "16-mixed" silently becomes bf16 there
        return "fp16 needs --device cuda"
    if model.startswith("gpt2"):
        try:
            import transformers  # noqa: F401
        except ImportError as exc:
            return f"the GPT-2 model needs transformers ({exc})"
    if deadline is not None:
        now = time.time()
        if now >= deadline:
            return "left out by --budget (spent)"
        if last is not None and now + last > deadline:
            return f"left out by --budget ({deadline - now:.0f} s left, the last {model} config took {last:.0f} s)"
    return None
