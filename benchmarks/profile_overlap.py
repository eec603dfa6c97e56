"""How much of the optimizer's work after backward is hidden: the time of ``unscale_ +
clip_grad_norm`` after backward with each bucket landed (and its grad stats computed) as it
completes, under backward, versus every bucket landed after backward
(``overlap_grad_sync=False``), plus a torch.profiler trace showing which kernels ran
concurrently with backward compute.

    python benchmarks/profile_overlap.py --out out/overlap        # one GPU (NCCL world 1)

At world 1 there is no reduce-scatter (nothing to communicate), so the trace shows the stats
kernels overlapping backward; the communication overlap needs world > 1.
"""
from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn

from shardamp.optim import DistributedFusedAdam
from shardamp.scaler import ShardedGradScaler


def _model(width: int, layers: int) -> nn.Module:
    blocks = []
    for _ in range(layers):
        blocks += [nn.Linear(width, width), nn.GELU()]
    return nn.Sequential(*blocks).cuda()


def _time_after_backward(landing: bool, args) -> dict:
    torch.manual_seed(0)
    model = _model(args.width, args.layers)
    # without overlap every bucket lands, and its stats pass runs, after backward (inside unscale_)
    opt = DistributedFusedAdam(model.parameters(), lr=1e-4, bucket_cap_mb=args.bucket_cap_mb,
                               overlap_grad_sync=landing)
    scaler = ShardedGradScaler("cuda")
    x = torch.randn(args.batch, args.width, device="cuda")
    post, total = [], []
    for it in range(args.iters + 3):
        e0, e1, e2, e3 = (torch.cuda.Event(enable_timing=True) for _ in range(4))
        e0.record()
        loss = model(x).float().pow(2).mean()
        scaler.scale(loss).backward()
        e1.record()
        scaler.unscale_(opt)
        opt.clip_grad_norm(1.0)
        e2.record()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        e3.record()
        torch.cuda.synchronize()
        if it >= 3:
            post.append(e1.elapsed_time(e2))
            total.append(e0.elapsed_time(e3))
    n_params = sum(p.numel() for p in model.parameters())
    return {"landing_stats": landing, "unscale_clip_ms": statistics.median(post),
            "iteration_ms": statistics.median(total), "params": n_params, "buckets": len(opt._buckets)}


def _profile(args, out: Path) -> dict:
    from torch.profiler import ProfilerActivity, profile

    torch.manual_seed(0)
    model = _model(args.width, args.layers)
    opt = DistributedFusedAdam(model.parameters(), lr=1e-4, bucket_cap_mb=args.bucket_cap_mb)
    scaler = ShardedGradScaler("cuda")
    x = torch.randn(args.batch, args.width, device="cuda")

    def it():
        scaler.scale(model(x).float().pow(2).mean()).backward()
        scaler.unscale_(opt)
        opt.clip_grad_norm(1.0)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()

    for _ in range(3):
        it()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        it()
        torch.cuda.synchronize()
    trace = out / "overlap_trace.json"
    prof.export_chrome_trace(str(trace))
    events = json.loads(trace.read_text())["traceEvents"]
    kernels = [e for e in events if e.get("cat") == "kernel"]
    stats = [e for e in kernels if "stats_kernel" in e["name"]]
    # backward compute = GEMM kernels on the main stream before the step kernel
    adam = [e for e in kernels if "adam_kernel" in e["name"]]
    first_adam = min(e["ts"] for e in adam) if adam else float("inf")
    compute = [e for e in kernels if e not in stats and e["ts"] < first_adam and "gemm" in e["name"].lower()]
    last_compute_end = max((e["ts"] + e["dur"] for e in compute), default=0)
    streams = {e["args"].get("stream") for e in stats}
    hidden = [e for e in stats if e["ts"] + e["dur"] <= last_compute_end]
    overlapping = [
        e for e in stats
        if any(c["ts"] < e["ts"] + e["dur"] and e["ts"] < c["ts"] + c["dur"] for c in compute)
    ]
    if trace.stat().st_size > 15 * 2**20:
        trace.unlink()  # too large to bring back; the summary below is what matters
    return {
        "stats_kernels": len(stats),
        "stats_kernel_streams": sorted(map(str, streams)),
        "compute_streams": sorted({str(e["args"].get("stream")) for e in compute}),
        "stats_kernels_finished_before_backward_ended": len(hidden),
        "stats_kernels_concurrent_with_a_gemm": len(overlapping),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="out/overlap")
    ap.add_argument("--width", type=int, default=4096)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--batch", type=int, default=4096)
    ap.add_argument("--bucket-cap-mb", type=float, default=64.0)
    ap.add_argument("--iters", type=int, default=20)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("profile_overlap.py needs a CUDA GPU")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("nccl", init_method=f"file://{tmp}/rdzv", rank=0, world_size=1)
        try:
            rows = [_time_after_backward(False, args), _time_after_backward(True, args)]
            prof = _profile(args, out)
        finally:
            dist.destroy_process_group()
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "timings": rows, "profile": prof}
    (out / "overlap.json").write_text(json.dumps(result, indent=2))
    for r in rows:
        print(f"landing_stats={r['landing_stats']!s:5}  unscale_+clip after backward: {r['unscale_clip_ms']:.3f} ms"
              f"  iteration: {r['iteration_ms']:.2f} ms  ({r['params'] / 1e6:.0f}M params, {r['buckets']} buckets)")
    print("profile:", json.dumps(prof))


if __name__ == "__main__":
    main()
