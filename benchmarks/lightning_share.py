"""Lightning's own share of an iteration on each optimizer's route: whether ``ShardampStrategy``
costs the host more than Lightning's default strategy does around the same loop.

bench_frameworks.py compares Lightning's two routes whole (``strategy="auto"`` with torch's AdamW
against ``strategy="shardamp"`` with DistributedFusedAdam), so a difference there is the
optimizers' and the strategies' together. Here each optimizer also runs the same iteration in a
bare loop (autocast, forward, ``zero_grad``, backward, ``step``: Lightning's automatic order),
and Lightning's share of a route is its iteration time minus the bare loop's with that
optimizer. A share larger on shardamp's route than on torch's is what its strategy, precision
plugin and monitor add (``--no-monitor``: one side more, the route without its monitor, which
reads the step's values and logs them every ``log_every_n_steps``; ``--auto-strategy``: one more,
DistributedFusedAdam under ``strategy="auto"``, with Lightning's own precision plugin and no
process group, so that the strategy's share and the optimizer's are told apart; ``--torch-group``:
torch's route beside a world-1 process group with its communicator made, which ShardampStrategy's
route has and ``strategy="auto"`` has not; ``--zero-first``: torch's route and shardamp's without
its monitor with the grads dropped at ``on_train_batch_start``, before the forward, where
Lightning drops them after it). Every side
starts without a process group: Lightning's DDP-based strategies leave theirs until the
interpreter exits, and a side run after one would run beside it.

The workload and optimizers are bench_frameworks' (``framework_models.workload("mlp")``: the
examples' MLP, 33.6M params at batch 64, its small version on the CPU; ``framework_routes.
make_optimizer``: the frameworks' decay groups and settings, torch's AdamW fused on CUDA), ``bf16-mixed``,
one device. Rounds are interleaved (each
round runs every side, ``--iters`` iterations each after ``--warmup``, in an order that
rotates); a side's time is the median of its per-iteration times. Printed: each side's median
over the rounds, the shares formed from those, and the difference of the two shares round by
round with its median (a host's speed drifts between rounds more than within one). Host time
between consecutive ``on_train_batch_start`` calls (Lightning) or loop iterations (bare),
nothing synchronized inside (a host-bound model: the host's time is the iteration's).

    python benchmarks/lightning_share.py --device cuda --rounds 5
    python benchmarks/lightning_share.py --device cuda --rounds 6 --no-monitor --auto-strategy --torch-group
    python benchmarks/lightning_share.py --device cpu --rounds 7 --iters 300
"""
from __future__ import annotations

import argparse
import datetime
import gc
import logging
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any, Callable, Dict, List

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from framework_models import Workload, workload  # noqa: E402  (bench_frameworks' MLP and its data)
from framework_routes import make_optimizer  # noqa: E402  (its Lightning route's optimizer, decay groups)

OPTIMIZERS = ("torch", "shardamp")
ROUTE = {"torch": "default", "shardamp": "shardamp"}  # framework_routes' names


class Setup:
    """The workload (bench_frameworks' ``mlp``; its small one on the CPU), the device and the
    iteration counts."""

    def __init__(self, device: torch.device, iters: int, warmup: int) -> None:
        self.device, self.iters, self.warmup = device, iters, warmup
        self.work: Workload = workload("mlp", small=device.type != "cuda")
        self.cuda = device.type == "cuda"

    def loader(self) -> torch.utils.data.DataLoader:
        return torch.utils.data.DataLoader(self.work.dataset(self.iters + self.warmup + 1),
                                           batch_size=self.work.batch, shuffle=False)


def _timed(run: Callable[[], None]) -> None:
    """``run()`` with Python's cyclic collector run before it and off inside it (as the
    frameworks' BlockTimer): a full collection would land in one side's round and scatter it."""
    gc.collect()
    gc.disable()
    try:
        run()
    finally:
        gc.enable()


def bare(route: str, s: Setup) -> List[float]:
    """The loop without Lightning: per-iteration host seconds after the warm-up."""
    world_one_group(s)  # DistributedFusedAdam's group: one process, as under torchrun
    net = s.work.model(s.device)
    opt = make_optimizer(ROUTE[route], net, s.cuda)
    times: List[float] = []

    def run() -> None:
        last = None
        for batch in s.loader():
            now = time.perf_counter()
            if last is not None:
                times.append(now - last)
            last = now
            batch = {k: v.to(s.device, non_blocking=True) for k, v in batch.items()}
            with torch.autocast(s.device.type, dtype=torch.bfloat16):
                loss = net(**batch)["loss"]
            opt.zero_grad()  # where Lightning's automatic optimization calls it: after the forward
            loss.backward()
            opt.step()

    _timed(run)
    return times[s.warmup:]


def world_one_group(s: Setup) -> None:
    """A world-1 process group (each side ends without one: ``main`` destroys what is left)."""
    dist.init_process_group("nccl" if s.cuda else "gloo", init_method=f"file://{tempfile.mkdtemp()}/pg",
                            rank=0, world_size=1)


def make_module(optimizer: str, s: Setup, zero_first: bool = False) -> Any:
    """The workload's model as a LightningModule whose ``configure_optimizers`` returns
    ``optimizer``'s (``"torch"`` or ``"shardamp"``) as bench_frameworks makes it.
    ``zero_first``: the grads are dropped at ``on_train_batch_start``, before the forward,
    instead of where Lightning's automatic optimization drops them (after the forward)."""
    import lightning.pytorch as pl

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = s.work.model(s.device)

        def training_step(self, batch: Dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
            return self.net(**batch)["loss"]

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return make_optimizer(ROUTE[optimizer], self.net, s.cuda)

    class ZeroFirst(Module):
        def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
            self.optimizers().zero_grad()

        def optimizer_zero_grad(self, epoch: int, batch_idx: int, optimizer: Any) -> None:
            pass  # done before the forward

    return ZeroFirst() if zero_first else Module()


def make_trainer(strategy: Any, s: Setup, callbacks: List[Any]) -> Any:
    """A Trainer of ``s``'s iterations on one device, ``bf16-mixed``, nothing logged or saved."""
    import lightning.pytorch as pl

    return pl.Trainer(
        strategy=strategy, accelerator="gpu" if s.cuda else "cpu", devices=1, precision="bf16-mixed",
        max_steps=s.iters + s.warmup + 1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, callbacks=callbacks,
    )


def strategy_of(route: str) -> Any:
    """The Trainer's strategy for ``route`` (``shardamp-no-monitor``: ShardampStrategy without its
    ShardampMonitor; ``shardamp-auto``: Lightning's ``"auto"``, no process group)."""
    from shardamp.integrations.lightning import ShardampStrategy

    named = {"torch": "auto", "torch-group": "auto", "shardamp": "shardamp", "shardamp-auto": "auto",
             "torch-zero-first": "auto"}
    return named.get(route) or ShardampStrategy(log_step_stats=False)


def lightning(route: str, s: Setup) -> List[float]:
    """The same iteration as a LightningModule's training_step under the route's strategy
    (``strategy_of``; ``torch-group``: torch's route beside a world-1 process group)."""
    import lightning.pytorch as pl

    if route == "torch-group":  # with its communicator made
        world_one_group(s)
        dist.all_reduce(torch.ones(1, device=s.device))
    times: List[float] = []

    class Timer(pl.Callback):
        last = None

        def on_train_batch_start(self, *args: Any) -> None:
            now = time.perf_counter()
            if Timer.last is not None:
                times.append(now - Timer.last)
            Timer.last = now

    trainer = make_trainer(strategy_of(route), s, [Timer()])
    module = make_module("torch" if route.startswith("torch") else "shardamp", s, zero_first=route.endswith("zero-first"))
    _timed(lambda: trainer.fit(module, s.loader()))
    return times[s.warmup:]


SIDES: Dict[str, Callable[[str, Setup], List[float]]] = {"bare": bare, "lightning": lightning}


def common_args(ap: argparse.ArgumentParser) -> None:
    """The device, the rounds and the iterations (this script's and lightning_phases.py's)."""
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--iters", type=int, default=200, help="timed iterations a side a round")
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--threads", type=int, default=1, help="torch's CPU threads (one: less scatter on a small VM)")


def setup_from(args: argparse.Namespace) -> Setup:
    """``common_args``' values applied (threads, device), Lightning's chatter off, the Setup."""
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.cuda.set_device(device.index or 0)
    warnings.filterwarnings("ignore")
    for name in ("lightning", "lightning.pytorch", "lightning.fabric"):
        logging.getLogger(name).setLevel(logging.ERROR)
    return Setup(device, args.iters, args.warmup)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    common_args(ap)
    ap.add_argument("--no-monitor", action="store_true",
                    help="one side more: Lightning's shardamp route without its ShardampMonitor (log_step_stats=False)")
    ap.add_argument("--auto-strategy", action="store_true",
                    help="one side more: DistributedFusedAdam under strategy='auto' (the optimizer in Lightning without "
                         "ShardampStrategy, its precision plugin and its monitor)")
    ap.add_argument("--torch-group", action="store_true",
                    help="one side more: torch's Lightning route beside a world-1 process group (ShardampStrategy's "
                         "route has one, strategy='auto' none)")
    ap.add_argument("--zero-first", action="store_true",
                    help="two sides more: torch's route and shardamp's without its monitor, each dropping the grads "
                         "before the forward (on_train_batch_start) instead of after it; adds the no-monitor side too")
    args = ap.parse_args()
    s = setup_from(args)
    sides = [(kind, route) for kind in SIDES for route in OPTIMIZERS]
    if args.no_monitor or args.zero_first:  # the zero-first shardamp side is read against it
        sides.append(("lightning", "shardamp-no-monitor"))
    if args.auto_strategy:
        sides.append(("lightning", "shardamp-auto"))
    if args.torch_group:
        sides.append(("lightning", "torch-group"))
    if args.zero_first:
        sides += [("lightning", "torch-zero-first"), ("lightning", "shardamp-no-monitor-zero-first")]
    medians: Dict[tuple, List[float]] = {}
    for r in range(args.rounds):
        for kind, route in sides[r % len(sides):] + sides[:r % len(sides)]:  # the order rotates
            times = SIDES[kind](route, s)
            if dist.is_initialized():  # Lightning's DDP-based strategies leave theirs to the interpreter's exit
                dist.destroy_process_group()  # every side starts without one, as it would alone
            medians.setdefault((kind, route), []).append(statistics.median(times) * 1e6)
    name = torch.cuda.get_device_name(s.device) if s.cuda else "cpu"
    print(f"lightning_share on {name}, torch {torch.__version__}, {datetime.date.today()}: bench_frameworks' "
          f"{'mlp' if s.cuda else 'small mlp'} ({s.work.params():,} params, batch {s.work.batch}), "
          f"bf16-mixed, {args.rounds} rounds x {args.iters} iterations; host us an iteration (median of the rounds' medians)")
    med = {k: statistics.median(v) for k, v in medians.items()}
    for (kind, route), v in sorted(medians.items()):
        print(f"  {kind:9s} {route:31s} {med[(kind, route)]:8.1f}   rounds {', '.join(f'{x:.1f}' for x in v)}")
    share = {route: med[("lightning", route)] - med[("bare", route)] for route in OPTIMIZERS}
    # each round's own difference too: the host's speed drifts between rounds, less within one
    diffs = [(ls - bs) - (lt - bt) for ls, bs, lt, bt in zip(medians[("lightning", "shardamp")], medians[("bare", "shardamp")],
                                                              medians[("lightning", "torch")], medians[("bare", "torch")])]
    print(f"Lightning's share: torch's route {share['torch']:+.1f} us, shardamp's route {share['shardamp']:+.1f} us, "
          f"shardamp's - torch's {share['shardamp'] - share['torch']:+.1f} us; per round: median "
          f"{statistics.median(diffs):+.1f} us (rounds {', '.join(f'{d:+.0f}' for d in diffs)})")

    def paired(label: str, route: str, base: str) -> None:
        """Lightning's ``route`` less its ``base`` round by round: the median and each round."""
        d = [a - b for a, b in zip(medians[("lightning", route)], medians[("lightning", base)])]
        print(f"{label}: median {statistics.median(d):+.1f} us (rounds {', '.join(f'{x:+.0f}' for x in d)})")

    if args.no_monitor:
        paired("ShardampMonitor's share (with it - without it)", "shardamp", "shardamp-no-monitor")
    if args.torch_group:
        paired("A process group's share on torch's route (with one - without)", "torch-group", "torch")
    if args.zero_first:
        for route, base in (("torch-zero-first", "torch"), ("shardamp-no-monitor-zero-first", "shardamp-no-monitor")):
            paired(f"zero_grad before the forward on {base}'s route (its side - {base})", route, base)
    if args.auto_strategy:
        own = "shardamp-no-monitor" if args.no_monitor else "shardamp"
        paired(f"ShardampStrategy's share (its route{' without the monitor' if args.no_monitor else ''} - "
               "DistributedFusedAdam under strategy='auto')", own, "shardamp-auto")

if __name__ == "__main__":
    main()
