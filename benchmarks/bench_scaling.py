"""Scaling benchmark: a GPT-style model on 1..N GPUs, shardamp (ZeRO-2) against torch DDP +
AdamW(fused=True): step time, optimizer memory per GPU, and how much of the reduce-scatter /
all-gather time is hidden under compute.

    torchrun --nproc-per-node 8 benchmarks/bench_scaling.py --out out/scaling
    torchrun --nproc-per-node 2 benchmarks/bench_scaling.py --layers 12 --dim 2048   # smaller

Per variant it reports (rank 0 prints; every rank's numbers go to scaling_w{world}.json):
  * median step time (forward + backward + unscale_/clip + step), bf16 autocast;
  * optimizer-owned bytes per GPU, split into fp32 state (master + moments: 12 B/param / world
    for shardamp when the model is fp32 and master IS the param) and grad buffers (shardamp: the
    reduced shards plus at most the buckets in flight; DDP: the full grads + its buckets);
  * backward's host time (issuing it, hooks included) against its device time: a host time at
    or above the device time means the GPU waits on Python;
  * from a torch.profiler trace of three consecutive steps: NCCL kernel time per step, and the
    part of it that ran concurrently with a compute kernel on another stream ("hidden"). NCCL
    kernel time includes any wait for the slowest rank, so it can exceed the transfer time.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Dict, List

import torch
import torch.distributed as dist
import torch.nn as nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parents[1] / "examples"))  # gpt.py, reporting.py
from gpt import GPT, GPTConfig, loss_fn  # noqa: E402
from reporting import optimizer_bytes  # noqa: E402

from shardamp.optim import DistributedFusedAdam  # noqa: E402


def _intervals_overlap(kernels: List[dict], comm: List[dict]) -> float:
    """Microseconds of ``comm`` kernels that overlap some non-comm kernel on another stream."""
    busy = sorted((k["ts"], k["ts"] + k["dur"]) for k in kernels)
    hidden = 0.0
    for c in comm:
        lo, hi = c["ts"], c["ts"] + c["dur"]
        covered, cursor = 0.0, lo
        for a, b in busy:
            if b <= cursor or a >= hi:
                continue
            a = max(a, cursor)
            covered += min(b, hi) - a
            cursor = min(b, hi)
        hidden += covered
    return hidden


def _profile_comm(step_fn, out: Path, tag: str, steps: int = 3) -> Dict[str, float]:
    """NCCL kernel time over ``steps`` consecutive steps and the part of it that ran under a
    compute kernel. Collectives launched after the last compute kernel (the final step's
    trailing all-gathers, which in training overlap the next forward) are left out; every
    earlier step's are counted, overlapped or not."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step_fn()
        torch.cuda.synchronize()
    trace = out / f"trace_{tag}_rank{dist.get_rank()}.json"
    prof.export_chrome_trace(str(trace))
    events = [e for e in json.loads(trace.read_text())["traceEvents"] if e.get("cat") == "kernel"]
    trace.unlink()  # large; the summary is what comes back
    compute = [e for e in events if "nccl" not in e["name"].lower()]
    last_compute = max((e["ts"] for e in compute), default=float("inf"))
    comm = [e for e in events if "nccl" in e["name"].lower() and e["ts"] < last_compute]
    total = sum(e["dur"] for e in comm)
    hidden = _intervals_overlap(compute, comm)
    return {"comm_us": total / steps, "hidden_us": hidden / steps, "hidden_fraction": hidden / total if total else None}


def _run_variant(name: str, args, out: Path) -> Dict[str, float]:
    torch.manual_seed(0)
    cuda = args.device == "cuda"
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    cfg = GPTConfig(vocab_size=args.vocab, seq_len=args.seq_len, dim=args.dim, layers=args.layers, heads=args.heads)
    model = GPT(cfg).to(device)
    n_params = sum(p.numel() for p in model.parameters())
    if name == "shardamp":
        opt = DistributedFusedAdam(model.parameters(), lr=1e-4, weight_decay=0.1,
                                   bucket_cap_mb=args.bucket_cap_mb, overlap_param_sync=args.overlap_param_sync)
        if args.overlap_param_sync:
            opt.attach(model)  # every param read in forward waits for its own all-gather
        net = model

        def clip():
            opt.clip_grad_norm(1.0)
    else:
        net = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=args.bucket_cap_mb)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1, fused=cuda)

        def clip():
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)

    g = torch.Generator(device=device).manual_seed(dist.get_rank())
    idx = torch.randint(0, args.vocab, (args.batch, args.seq_len), device=device, generator=g)

    def forward_loss():
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=cuda):
            return loss_fn(net(idx), idx)

    def step():
        loss = forward_loss()
        loss.backward()
        clip()
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(args.warmup):
        step()
    times = []
    for _ in range(args.iters):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            step()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            step()
            times.append((time.perf_counter() - t0) * 1e3)
    # Is backward host-bound? The host's time to issue it (hooks included) against the device's
    # time to run it: host >= device means the GPU waits on Python.
    host_bw, dev_bw = [], []
    for _ in range(3 if cuda else 0):
        loss = forward_loss()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0 = time.perf_counter()
        start.record()
        loss.backward()
        end.record()
        host_bw.append((time.perf_counter() - t0) * 1e3)
        end.synchronize()
        dev_bw.append(start.elapsed_time(end))
        clip()
        opt.step()
        opt.zero_grad(set_to_none=True)
    # optimizer memory measured right after backward (grads/buckets alive) and after the step
    forward_loss().backward()
    after_backward = optimizer_bytes(opt, model)
    clip()
    opt.step()
    after_step = optimizer_bytes(opt, model)
    opt.zero_grad(set_to_none=True)
    comm = _profile_comm(step, out, name) if cuda else {"comm_us": 0.0, "hidden_us": 0.0, "hidden_fraction": None}
    result = {
        "params": n_params, "step_ms": statistics.median(times),
        "optimizer_bytes_per_param_after_backward": after_backward / n_params,
        "optimizer_bytes_per_param_after_step": after_step / n_params,
        "peak_allocated_GiB": torch.cuda.max_memory_allocated() / 2**30 if cuda else None, **comm,
        "backward_host_ms": statistics.median(host_bw) if host_bw else None,
        "backward_device_ms": statistics.median(dev_bw) if dev_bw else None,
    }
    if cuda:  # the variant's tensors are freed when this function returns
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "out/scaling")))
    ap.add_argument("--dim", type=int, default=4096)
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--bucket-cap-mb", type=float, default=100.0)
    ap.add_argument("--overlap-param-sync", action=argparse.BooleanOptionalAction, default=True,
                    help="shardamp: leave the all-gathers in flight after step, waited per module in "
                         "the next forward (default on; --no-overlap-param-sync waits in step)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--variants", default="shardamp,ddp")
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                    help="cpu: a gloo smoke run of the script itself (no profile), not a benchmark")
    args = ap.parse_args()
    if "LOCAL_RANK" not in os.environ:
        raise SystemExit("bench_scaling.py runs under torchrun (see --help)")
    if args.device == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit("--device cuda: no GPU visible; use --device cpu for a smoke run")
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl" if args.device == "cuda" else "gloo")
    args.out.mkdir(parents=True, exist_ok=True)
    world = dist.get_world_size()
    results = {v: _run_variant(v, args, args.out) for v in args.variants.split(",")}
    name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    record = {"world": world, "device": name, "torch": torch.__version__,
              "args": {k: str(v) for k, v in vars(args).items()}, "results": results}
    (args.out / f"scaling_w{world}_rank{dist.get_rank()}.json").write_text(json.dumps(record, indent=2))
    if dist.get_rank() == 0:
        for name, r in results.items():
            hidden = r["hidden_fraction"]
            print(f"world {world} {name:9s} {r['params'] / 1e6:.0f}M params  step {r['step_ms']:.1f} ms  "
                  f"optimizer {r['optimizer_bytes_per_param_after_step']:.2f} B/param after step, "
                  f"{r['optimizer_bytes_per_param_after_backward']:.2f} after backward  "
                  f"comm {r['comm_us'] / 1e3:.2f} ms/step, hidden {'-' if hidden is None else f'{100 * hidden:.0f}%'}"
                  + (f"  backward host {r['backward_host_ms']:.1f} / device {r['backward_device_ms']:.1f} ms"
                     if r["backward_host_ms"] is not None else ""))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
