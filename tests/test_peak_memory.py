"""Peak memory at world 1 against torch.optim.AdamW(fused=True), on the CPU: the allocator's
timeline from torch.profiler's memory events (every allocation and free, in order), over the
optimizer's construction and three whole iterations, as benchmarks/bench_host.py measures it on
a GPU.

World 1 keeps no grad memory between ``zero_grad`` and backward and holds a staged grad as torch
holds ``param.grad``; the one transient is a bucket's flush, when its buffer is allocated while
its staged grads are still alive: at most one bucket (``bucket_cap_mb``) above torch, at one
instant of backward. Where activations dominate (conv nets, transformers at a real batch) that
instant is not the peak.
"""
from __future__ import annotations

import gc
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from shardamp.optim import DistributedFusedAdam
from shardamp.scaler import ShardedGradScaler


def cpu_peak_bytes(fn: Callable[[], None]) -> int:
    """Peak CPU bytes allocated while ``fn`` runs, above what was allocated when it started."""
    from torch.profiler import ProfilerActivity, profile

    # Garbage of an earlier run (reference cycles) freed by the collector in the middle of fn
    # would lower its peak by that garbage's size: collect first, and not during fn.
    gc.collect()
    gc.disable()
    try:
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            fn()
    finally:
        gc.enable()
    # the raw events: the profiler's tables fold a op's allocations into the op, losing the order
    events = [(e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
              if e.name() == "[memory]" and e.device_type() == torch.autograd.DeviceType.CPU]
    assert events, "torch.profiler recorded no memory events: its raw-event API changed"
    current = peak = 0
    for _, nbytes in sorted(events):
        current += nbytes
        peak = max(peak, current)
    return peak


def _run(impl: str, make: Callable[[], nn.Module], batch, scaled: bool, **kw) -> int:
    x, y = batch

    def train() -> None:
        torch.manual_seed(0)
        model = make()
        params = list(model.parameters())
        if impl == "torch":
            opt = torch.optim.AdamW(params, lr=1e-3, fused=True)
            scaler = torch.amp.GradScaler("cpu", enabled=scaled)
            clip = lambda: torch.nn.utils.clip_grad_norm_(params, 1.0)  # noqa: E731
        else:
            opt = DistributedFusedAdam(params, lr=1e-3, **kw)
            scaler = ShardedGradScaler("cpu", enabled=scaled)
            clip = lambda: opt.clip_grad_norm(1.0)  # noqa: E731
        for _ in range(3):
            opt.zero_grad(set_to_none=True)
            scaler.scale(F.cross_entropy(model(x), y)).backward()
            if scaled:
                scaler.unscale_(opt)
            clip()
            scaler.step(opt)
            scaler.update()

    train()  # warm: lazy imports and caches are not the optimizer's memory
    return cpu_peak_bytes(train)


def _mlp(width: int = 256, layers: int = 6) -> nn.Module:
    return nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)], nn.Linear(width, 10))


def _convnet() -> nn.Module:
    def block(cin: int, cout: int) -> nn.Module:
        return nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU())

    return nn.Sequential(block(3, 16), block(16, 32), nn.MaxPool2d(2), block(32, 64), block(64, 64),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(64, 10))


def test_world1_peak_activations_dominate_is_torchs() -> None:
    g = torch.Generator().manual_seed(0)
    batch = (torch.randn(16, 3, 32, 32, generator=g), torch.randint(0, 10, (16,), generator=g))
    for scaled in (True, False):
        ours = _run("shardamp", _convnet, batch, scaled)
        theirs = _run("torch", _convnet, batch, scaled)
        # a few small device scalars (stats, norms) are all shardamp may hold on top
        assert ours <= theirs + 64 * 1024, (scaled, ours, theirs)


def test_world1_peak_params_dominate_at_most_one_bucket_above_torch() -> None:
    g = torch.Generator().manual_seed(0)
    batch = (torch.randn(4, 256, generator=g), torch.randint(0, 10, (4,), generator=g))
    model = _mlp()
    param_bytes = sum(p.numel() * 4 for p in model.parameters())
    layer = 256 * 257 * 4
    for cap_layers in (1, 3):  # buckets of about one and three layers
        cap_mb = cap_layers * layer / 2**20
        ours = _run("shardamp", _mlp, batch, True, bucket_cap_mb=cap_mb)
        theirs = _run("torch", _mlp, batch, True)
        # 4x the params at steady state (params, moments, grads) on both sides
        assert theirs >= 4 * param_bytes, (theirs, param_bytes)
        assert ours <= theirs + cap_layers * layer + 64 * 1024, (cap_layers, ours - theirs, layer)


def test_deleted_optimizer_frees_its_state_without_the_cyclic_gc() -> None:
    """As torch.optim.AdamW's state does, a dropped DistributedFusedAdam's moments and grad
    shards are freed by reference counting alone: a reference cycle would keep them (3x the
    params' bytes; ResNet-50's 0.38 GiB with its master shards) alive until Python's collector
    happens to run."""
    import weakref

    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(4, 256, generator=g), torch.randint(0, 10, (4,), generator=g)
    cap = 256 * 257 * 4 * 2 / 2**20  # about two layers a bucket: several buckets
    for impl, kw in (("torch", {}), ("shardamp", dict(bucket_cap_mb=cap)), ("shardamp", dict(max_grad_norm=1.0))):
        torch.manual_seed(0)
        model = _mlp()
        params = list(model.parameters())
        groups = [{"params": params[:4]}, {"params": params[4:], "lr": 1e-4}]
        if impl == "torch":
            opt = torch.optim.AdamW(groups, lr=1e-3)
            scaler = torch.amp.GradScaler("cpu")
        else:
            opt = DistributedFusedAdam(groups, lr=1e-3, **kw)
            scaler = ShardedGradScaler("cpu")
        for _ in range(2):
            opt.zero_grad(set_to_none=True)
            scaler.scale(F.cross_entropy(model(x), y)).backward()
            scaler.unscale_(opt)
            scaler.step(opt)
            scaler.update()
        if impl == "torch":
            state = [t for s in opt.state.values() for t in (s["exp_avg"], s["exp_avg_sq"])]
        else:
            state = [t for b in opt._buffers for t in (b.exp_avg, b.exp_avg_sq, b.grad_shard)]
            assert len(opt._buffers) > 1 or "bucket_cap_mb" not in kw
        refs = [weakref.ref(t) for t in state]
        del state
        gc.collect()
        gc.disable()
        try:
            del opt, scaler
            alive = sum(r() is not None for r in refs)
        finally:
            gc.enable()
        assert refs and alive == 0, (impl, kw, f"{alive} of {len(refs)} state tensors outlived the optimizer")
