"""GPU variants of the framework tests: each examples/*_train.py script with --device cuda in
bf16, fp16 and fp32 (every visible GPU, NCCL; world 1 on one GPU) must print PASS for its parity
check against unsharded torch.optim.AdamW (the criterion of examples/framework_common.py: tight
after the first step, within torch's own spread after the last; the Trainer also for resuming
from save_steps) and, in bf16/fp16, a step-time line against the framework's default. The
report lines are printed (pytest -s shows them). Skipped without a GPU."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


@pytest.mark.parametrize("script, framework", [
    ("lightning_train.py", "lightning"), ("accelerate_train.py", "accelerate"),
    ("transformers_train.py", "transformers"),
])
@pytest.mark.parametrize("precision", ["bf16", "fp16", "fp32"])
def test_example_on_cuda(script, framework, precision, tmp_path) -> None:
    pytest.importorskip(framework)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                             "MASTER_PORT")}
    timed = precision != "fp32"  # fp32: the parity check only
    proc = subprocess.run(
        [sys.executable, str(EXAMPLES / script), "--device", "cuda", "--precision", precision, "--out", str(tmp_path)]
        + ([] if timed else ["--no-baseline"]),
        capture_output=True, text=True, timeout=600, env=env,
    )
    out = proc.stdout + proc.stderr
    print("\n".join(line for line in out.splitlines()
                    if line.startswith(("parity", "  ", "step time", "checkpoint at step"))), flush=True)
    assert proc.returncode == 0, out[-5000:]
    parity = [line for line in out.splitlines() if line.startswith("parity vs torch.optim.AdamW")]
    assert parity and all(line.endswith("PASS") for line in parity), out[-5000:]
    if timed:
        assert "step time" in out and "DDP + AdamW(fused)" in out, out[-5000:]
    if framework == "transformers":
        assert "+ resume_from_checkpoint ends on the same params: PASS" in out, out[-5000:]


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_lightning_auto_strategy_fit_ends_with_the_module_and_grads_on_the_cpu(precision) -> None:
    """DistributedFusedAdam under Lightning's ``strategy="auto"`` on one GPU: its teardown moves the
    module to the CPU after the last step, grads held; params and grads arrive there as torch
    AdamW's do under the same Trainer."""
    pl = pytest.importorskip("lightning.pytorch")
    from torch.utils.data import DataLoader, TensorDataset

    from shardamp.optim import DistributedFusedAdam

    class Module(pl.LightningModule):
        def __init__(self, ours: bool) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
            self.ours = ours

        def training_step(self, batch, batch_idx):
            x, y = batch
            return torch.nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self):
            kind = DistributedFusedAdam if self.ours else torch.optim.AdamW
            return kind(self.parameters(), lr=1e-2, weight_decay=0.01)

    g = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(64, 16, generator=g), torch.randn(64, 4, generator=g))
    modules = []
    for ours in (True, False):
        module = Module(ours)
        # Lightning's own mixed-precision plugin refuses a clip for any optimizer that unscales
        # itself (torch's fused AdamW too): clipped in fp32 only
        clip = 0.5 if precision == "32-true" else None
        trainer = pl.Trainer(accelerator="gpu", devices=1, strategy="auto", precision=precision, max_steps=4,
                             gradient_clip_val=clip, logger=False, enable_progress_bar=False,
                             enable_model_summary=False, enable_checkpointing=False)
        trainer.fit(module, DataLoader(data, batch_size=16))
        modules.append(module)
    tol = dict(rtol=1e-4, atol=1e-5) if precision == "32-true" else dict(rtol=2e-2, atol=2e-3)
    for p, q in zip(modules[0].parameters(), modules[1].parameters()):
        assert p.device.type == "cpu" and p.grad is not None and p.grad.device.type == "cpu"
        assert type(p.grad) is torch.Tensor
        torch.testing.assert_close(p, q, **tol)
        torch.testing.assert_close(p.grad, q.grad, **tol)
