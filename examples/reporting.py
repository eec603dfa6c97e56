"""What the example prints and saves: progress, measured optimizer memory, the loss-curve plot.

tqdm and matplotlib are optional: without tqdm progress is printed every few steps, without
matplotlib the plot is skipped (the numbers still go to metrics.json).
"""
from __future__ import annotations

import dataclasses
import json
import os
import sys
from typing import Any, Dict, Iterable, List, Optional, Set

import torch

try:
    from tqdm import tqdm
except ImportError:  # optional dependency
    tqdm = None


class Progress:
    """A tqdm bar on rank 0 (other ranks stay silent), or a line every ``log_every`` steps."""

    def __init__(self, total: int, enabled: bool, log_every: int) -> None:
        self.enabled, self.total, self.log_every = enabled, total, log_every
        self.bar = tqdm(total=total, desc="train", dynamic_ncols=True) if enabled and tqdm else None

    def update(self, step: int, n: int, metrics: Dict[str, str]) -> None:
        """``step`` steps are done, ``n`` of them since the last call."""
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.set_postfix(metrics, refresh=False)
            self.bar.update(n)
        else:
            print(f"step {step:>5}/{self.total} " + " ".join(f"{k} {v}" for k, v in metrics.items()), flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


# ------------------------------------------------------------------ memory accounting
def _collect(obj: Any, exclude: Set[int], seen: Set[int], out: Dict[int, int]) -> None:
    """Record (storage pointer -> bytes) of every tensor reachable from ``obj``.

    Walks containers, dataclasses and the optimizer's own helper objects (anything defined in a
    shardamp module), so it keeps measuring whatever the optimizer holds as its internals evolve.
    Storages, not views, are counted: a view keeps its whole allocation alive.
    """
    if isinstance(obj, torch.Tensor):
        if obj.layout != torch.strided:
            return
        try:
            storage = obj.untyped_storage()
            ptr = storage.data_ptr()
        except RuntimeError:  # no storage of its own (a managed param's p.grad view): holds no bytes
            return
        if ptr and ptr not in exclude:
            out[ptr] = storage.nbytes()
        return
    if id(obj) in seen or isinstance(obj, (str, bytes, int, float, bool, type(None))):
        return
    seen.add(id(obj))
    children: Iterable[Any] = ()
    if isinstance(obj, dict):
        children = obj.values()
    elif isinstance(obj, (list, tuple, set, frozenset)):
        children = obj
    elif isinstance(obj, torch.optim.Optimizer) or dataclasses.is_dataclass(obj) or (
        type(obj).__module__.startswith("shardamp") and hasattr(obj, "__dict__")
    ):
        children = vars(obj).values()
    for child in children:
        _collect(child, exclude, seen, out)


def optimizer_bytes(opt: torch.optim.Optimizer, model: torch.nn.Module) -> int:
    """Bytes this rank holds for training ``model`` beyond the model's own weights: every tensor
    the optimizer owns (master weights if separate, moments, grad shards, bucket buffers, step
    counts) plus any ``param.grad`` (torch keeps full grads; DistributedFusedAdam keeps none)."""
    params = list(model.parameters())
    exclude = {p.untyped_storage().data_ptr() for p in params}
    out: Dict[int, int] = {}
    _collect(opt, exclude, set(), out)
    for p in params:
        if p.grad is not None:
            _collect(p.grad, exclude, set(), out)
    return sum(out.values())


def memory_lines(
    ours: List[int], ours_peak: List[int], torch_bytes: Optional[int], n_params: int, bucket_cap_mb: float
) -> List[str]:
    """``ours``/``ours_peak``: per rank; ``torch_bytes``: torch.optim.AdamW on one process."""
    world = len(ours)
    mb = lambda b: f"{b / 2**20:.2f} MiB"  # noqa: E731
    per = lambda b: f"{b / n_params:.2f} B/param"  # noqa: E731
    worst = max(ours)
    line = (
        f"optimizer memory per rank (world {world}, {n_params:,} params): "
        f"DistributedFusedAdam {per(worst)} ({mb(worst)})"
    )
    if torch_bytes is not None:
        line += f" vs torch.optim.AdamW {per(torch_bytes)} ({mb(torch_bytes)}), ratio {torch_bytes / worst:.2f}x"
    lines = [
        line,
        "  measured after the last step, before zero_grad: optimizer-owned tensors + grads, "
        "model weights excluded (AdamW: 2 fp32 moments + the fp32 grad per param)",
        f"  peak right after backward, with the full-size bucket buffers (bucket_cap_mb={bucket_cap_mb:g}) "
        f"still held by their reduce-scatters: {per(max(ours_peak))} ({mb(max(ours_peak))})",
    ]
    if max(ours) > 1.01 * min(ours):  # shards are padded to equal sizes, so this is rare
        lines.append("  by rank: " + ", ".join(per(b) for b in ours))
    return lines


# ------------------------------------------------------------------ outputs
def save_outputs(out_dir: str, metrics: Dict[str, Any], title: str) -> None:
    """Write metrics.json and, if matplotlib is installed, loss.png into ``out_dir``."""
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, "metrics.json")
    with open(path, "w") as f:
        json.dump(metrics, f, indent=1)
    print(f"metrics: {os.path.abspath(path)}")
    try:
        import matplotlib

        matplotlib.use("Agg")  # no display needed
        import matplotlib.pyplot as plt
    except ImportError:
        print("loss curve: skipped (matplotlib is not installed: pip install matplotlib)", file=sys.stderr)
        return
    fig, ax = plt.subplots(figsize=(7, 4))
    steps = range(1, len(metrics["loss"]) + 1)
    ax.plot(steps, metrics["loss"], label="train loss (mean over ranks)", linewidth=1)
    if metrics.get("val_loss") is not None:
        ax.axhline(metrics["val_loss"], color="tab:orange", linestyle="--", label="final val loss")
    if metrics.get("ref_loss"):
        ax.plot(range(1, len(metrics["ref_loss"]) + 1), metrics["ref_loss"], "k:", label="torch.optim.AdamW reference")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats/char)")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    png = os.path.join(out_dir, "loss.png")
    fig.savefig(png, dpi=120)
    plt.close(fig)
    print(f"loss curve: {os.path.abspath(png)}")
