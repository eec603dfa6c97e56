"""Lightning's real launch path in CI: examples/lightning_train.py with devices=2 on the CPU, where
Lightning's own launcher starts the second rank (the framework tests start ranks themselves).
The accelerate and transformers examples launch through torchrun the same way; their GPU runs
are in test_cuda_frameworks.py."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("lightning")

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def test_lightning_example_launches_two_ranks_and_passes_parity(tmp_path) -> None:
    """By its registered name, with each rank writing its optimizer shard beside the checkpoint."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                             "MASTER_PORT", "NODE_RANK")}
    proc = subprocess.run(
        [sys.executable, str(EXAMPLES / "lightning_train.py"), "--steps", "4", "--warmup", "1", "--no-baseline",
         "--out", str(tmp_path), "--strategy-name", "shardamp_sharded_checkpoint"],
        capture_output=True, text=True, timeout=600, env=env,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-5000:]
    assert "MEMBER: 2/2" in out, out[-5000:]  # Lightning started the second process
    assert "world 2, clipped every step: yes" in out and "PASS" in out, out[-5000:]
    assert "ModelCheckpoint: ['epoch=0-step=4.ckpt', 'epoch=0-step=4.ckpt.optim0']" in out, out[-5000:]


@pytest.mark.parametrize("run, passes", [
    ({}, True), ({"fused": True}, True), ({"exact_norm": True}, True),  # torch itself, rounded otherwise
    ({"lr_scale": 1.01}, False), ({"clip": False}, False),  # wrong training
])
def test_parity_check_passes_torch_and_fails_a_wrong_lr_or_no_clipping(run, passes, capsys) -> None:
    import argparse

    import torch

    sys.path.insert(0, str(EXAMPLES))
    import framework_common as common

    args = argparse.Namespace(device="cpu", precision="fp32", world_size=1, steps=8, accumulate=2, batch_size=8,
                              dim=32, depth=2, max_grad_norm=0.05)
    seen = [torch.arange(i * 8, (i + 1) * 8) for i in range(16)]  # one rank, 8 steps of 2 micro-batches
    params, norms, snapshots = common.reference(args, [seen], "cpu", **run)
    assert common.report_parity(args, "check", params, seen, norms, snapshots) is passes
    line = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("parity"))
    assert line.endswith("PASS" if passes else "FAIL"), line
