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
