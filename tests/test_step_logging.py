"""The integrations log grad_norm, loss_scale and skipped_steps into each framework's own logger:
Lightning (ShardampMonitor, added by the strategy), the transformers Trainer's log history and
accelerate's trackers. The logged norms are checked against an unsharded torch loop's
``clip_grad_norm_`` on the same batches."""
from __future__ import annotations

import csv
import os
import tempfile
from typing import List

import pytest
import torch
import torch.nn as nn

from dist_helper import run_distributed

STEPS, LR, CLIP = 4, 0.05, 0.5


def _data() -> List[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(4, 8, generator=g), torch.randn(4, 1, generator=g)) for _ in range(STEPS)]


def _model() -> nn.Module:
    torch.manual_seed(1)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))


def _reference_norms(clip: float = CLIP, batches=None) -> List[float]:
    """Unsharded torch: AdamW, each step's pre-clip global norm from clip_grad_norm_."""
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    norms = []
    for x, y in (batches if batches is not None else _data()):
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip if clip > 0 else float("inf"))))
        opt.step()
    return norms


# ---------------------------------------------------------------- accelerate
def test_accelerate_trackers_receive_the_step_values() -> None:
    pytest.importorskip("accelerate")
    from accelerate.tracking import GeneralTracker

    from shardamp.integrations.accelerate import ShardampAccelerator
    from shardamp.optim import DistributedFusedAdam

    class Recorder(GeneralTracker):
        name = "recorder"
        requires_logging_directory = False

        def __init__(self) -> None:
            super().__init__()
            self.logged = []

        @property
        def tracker(self):  # noqa: D401 - accelerate's interface
            return self

        def store_init_configuration(self, values) -> None:
            pass

        def log(self, values, step=None, **kwargs) -> None:
            self.logged.append((step, dict(values)))

    recorder = Recorder()
    acc = ShardampAccelerator(cpu=True, log_with=[recorder])
    acc.init_trackers("run")
    model = _model()
    opt = DistributedFusedAdam(model.parameters(), lr=LR)
    model, opt = acc.prepare(model, opt)
    for i, (x, y) in enumerate(_data()):
        opt.zero_grad()
        acc.backward(nn.functional.mse_loss(model(x), y))
        acc.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        acc.log({"loss": 1.0, "grad_norm": -1.0} if i == 0 else {"loss": 1.0}, step=i)
    acc.end_training()
    ref = _reference_norms()
    assert len(recorder.logged) == STEPS
    assert recorder.logged[0][1]["grad_norm"] == -1.0  # the caller's own value wins
    for (step, values), norm in list(zip(recorder.logged, ref))[1:]:
        assert values["grad_norm"] == pytest.approx(norm, rel=1e-5), (step, values)
        assert values["skipped_steps"] == 0.0 and "loss_scale" not in values  # no scaler: no scale


# ---------------------------------------------------------------- transformers
def test_trainer_log_history_has_the_step_values(tmp_path) -> None:
    pytest.importorskip("transformers")
    from torch.utils.data import Dataset
    from transformers import TrainingArguments

    from shardamp.integrations.transformers import ShardampTrainer

    class Pairs(Dataset):
        def __init__(self) -> None:
            self.rows = [(x[i], y[i]) for x, y in _data() for i in range(4)]

        def __len__(self) -> int:
            return len(self.rows)

        def __getitem__(self, i):
            return {"x": self.rows[i][0], "labels": self.rows[i][1]}

    class Regressor(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = _model()

        def forward(self, x, labels=None):
            out = self.net(x)
            return {"loss": nn.functional.mse_loss(out, labels), "logits": out}

    args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=4, max_steps=STEPS,
                             learning_rate=LR, weight_decay=0.0, lr_scheduler_type="constant", warmup_steps=0,
                             max_grad_norm=0.0, logging_steps=1, report_to=[], save_strategy="no", use_cpu=True,
                             dataloader_drop_last=True, seed=0, data_seed=0, disable_tqdm=True)
    trainer = ShardampTrainer(model=Regressor(), args=args, train_dataset=Pairs())
    trainer.get_train_dataloader = _sequential_loader(trainer, Pairs())
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    ref = _reference_norms(clip=0.0)
    assert len(logs) == STEPS
    for entry, norm in zip(logs, ref):
        assert entry["grad_norm"] == pytest.approx(norm, rel=1e-5), entry  # max_grad_norm=0: ours, not the Trainer's
        assert entry["skipped_steps"] == 0.0, entry


def _sequential_loader(trainer, dataset):
    from torch.utils.data import DataLoader

    def loader():  # the reference's batch order (the Trainer would shuffle)
        return DataLoader(dataset, batch_size=4, shuffle=False, collate_fn=trainer.data_collator)

    return loader


# ---------------------------------------------------------------- Lightning
def _lightning_rank(rank: int, world: int, out_dir: str, accumulate: int = 1) -> dict:
    import lightning as L
    from lightning.pytorch.loggers import CSVLogger

    import shardamp.integrations.lightning  # noqa: F401  (registers "shardamp")
    from shardamp.integrations import _step_logging
    from shardamp.integrations.lightning import ShardampMonitor
    from shardamp.optim import DistributedFusedAdam

    from lightning.pytorch.callbacks import Callback
    from lightning.pytorch.profilers import PassThroughProfiler

    entered = set()  # (callback class, hook) of every callback hook Lightning entered

    class Entered(PassThroughProfiler):
        def start(self, action_name: str) -> None:
            if action_name.startswith("[Callback]"):
                owner, hook = action_name[len("[Callback]"):].rsplit(".", 1)
                entered.add((owner.rsplit(".", 1)[-1], hook))

    class Control(Callback):  # overrides nothing: Lightning enters each of its hooks anyway
        pass

    reads = []  # each host read of the step values (one per logged optimizer step)
    real_values = _step_logging.step_values
    _step_logging.step_values = lambda optimizers: reads.append(1) or real_values(optimizers)

    class Module(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = _model()

        def training_step(self, batch, batch_idx):
            x, y = batch
            seen.append((x.clone(), y.clone()))  # the reference trains on exactly these batches
            return nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self):
            return DistributedFusedAdam(self.parameters(), lr=LR)

    seen: list = []
    data = torch.utils.data.DataLoader(
        [(x[i], y[i]) for x, y in _data() for i in range(4)], batch_size=4, shuffle=False)
    trainer = L.Trainer(strategy="shardamp", accelerator="cpu", devices=1, max_steps=STEPS // accumulate,
                        precision="32-true", gradient_clip_val=CLIP, log_every_n_steps=1,
                        accumulate_grad_batches=accumulate, logger=CSVLogger(out_dir, name="run"),
                        enable_progress_bar=False, enable_checkpointing=False, enable_model_summary=False,
                        callbacks=[Control()], profiler=Entered())
    try:
        trainer.fit(Module(), data)
    finally:
        _step_logging.step_values = real_values
    monitors = [c for c in trainer.callbacks if isinstance(c, ShardampMonitor)]
    return {"monitors": len(monitors), "log_dir": trainer.logger.log_dir, "batches": seen, "reads": len(reads),
            "global_step": trainer.global_step, "entered": sorted(entered)}


def test_lightning_strategy_logs_through_its_monitor() -> None:
    pytest.importorskip("lightning")
    with tempfile.TemporaryDirectory() as tmp:
        out = run_distributed(_lightning_rank, 1, tmp)[0]
        with open(os.path.join(out["log_dir"], "metrics.csv")) as f:
            rows = [r for r in csv.DictReader(f) if r.get("grad_norm")]
    assert out["monitors"] == 1  # added by the strategy, once
    ref = _reference_norms(batches=out["batches"])
    assert len(out["batches"]) == STEPS and len(rows) == STEPS  # one row per logged step (log_every_n_steps=1)
    for row, norm in zip(rows, ref):
        assert float(row["grad_norm"]) == pytest.approx(norm, rel=1e-5), row  # the pre-clip norm the step used
        assert float(row["skipped_steps"]) == 0.0
        assert not row.get("loss_scale")  # 32-true: no scaler, no scale


PER_BATCH_HOOKS = {"on_train_batch_start", "on_before_backward", "on_after_backward", "on_before_optimizer_step",
                   "on_before_zero_grad", "on_train_batch_end"}


def test_lightning_monitor_is_entered_once_a_training_batch() -> None:
    """Lightning enters every callback's hook of each name (a profiler section and a call each);
    the monitor's per-batch hooks but the one it uses are None, which Lightning skips: a
    callback overriding nothing is entered six times a batch, the monitor once."""
    pytest.importorskip("lightning")
    with tempfile.TemporaryDirectory() as tmp:
        out = run_distributed(_lightning_rank, 1, tmp)[0]
    hooks = {owner: {h for o, h in out["entered"] if o == owner and h in PER_BATCH_HOOKS}
             for owner in ("Control", "ShardampMonitor")}
    assert hooks["Control"] == PER_BATCH_HOOKS, out["entered"]
    assert hooks["ShardampMonitor"] == {"on_train_batch_end"}, out["entered"]
    assert ("ShardampMonitor", "on_fit_start") in out["entered"]  # the others as any callback's


def test_lightning_monitor_reads_once_per_optimizer_step_under_accumulation() -> None:
    """accumulate_grad_batches=2: every micro-batch ends a batch, but the values are read (a
    host read) and logged once per optimizer step, with the step's pre-clip norm."""
    pytest.importorskip("lightning")
    with tempfile.TemporaryDirectory() as tmp:
        out = run_distributed(_lightning_rank, 1, tmp, 2)[0]
        with open(os.path.join(out["log_dir"], "metrics.csv")) as f:
            rows = [r for r in csv.DictReader(f) if r.get("grad_norm")]
    assert len(out["batches"]) == STEPS and out["global_step"] == STEPS // 2
    assert out["reads"] == STEPS // 2, out["reads"]  # not once per micro-batch
    assert len(rows) == STEPS // 2
    # the reference: the mean of each pair of micro-batch losses' grads (Lightning divides the loss)
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    want = []
    for k in range(0, STEPS, 2):
        opt.zero_grad()
        for x, y in out["batches"][k:k + 2]:
            (nn.functional.mse_loss(model(x), y) / 2).backward()
        want.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)))
        opt.step()
    for row, norm in zip(rows, want):
        assert float(row["grad_norm"]) == pytest.approx(norm, rel=1e-5), row
