"""Where the step's device time goes: a torch.profiler trace of each bench_step.py variant.

For every variant (shardamp eager / CUDA graph, torch's sequence, the raw kernels; of each kind
in --kinds, bench_step.py's KINDS), it runs --iters timed bodies with the host ahead of the GPU
(as bench_step.py's primary timing) under the profiler and prints, per iteration: the device
span from the first to the last kernel of the body, the summed kernel time, the number of
kernels, and the kernels that cost the most. The gap between span and summed time is launch
gaps; kernels other than the step are the small ops around it. --timeline also prints every
kernel of the median iteration in order: its start after the previous one ended (the gap) and
its duration.

    python benchmarks/profile_step.py --out out/       # needs a CUDA GPU
    python benchmarks/profile_step.py --kinds "fp32+bf16 moments" --rows graph --timeline
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_step as bs  # noqa: E402


def _kernels(prof) -> list:
    out = []
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA and e.device_time > 0:
            out.append((e.time_range.start, e.time_range.end, e.name))
    return sorted(out)


def profile_variant(name: str, prep, body, timer: bs.Timer, iters: int, timeline: bool = False) -> dict:
    for _ in range(3):
        timer.time(prep, body, ahead=True)
    spans, busy, counts, runs = [], [], [], []
    by_name: dict = defaultdict(float)
    for _ in range(iters):
        prep()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            torch.cuda._sleep(timer.sleep_cycles)
            torch.cuda.synchronize()  # the sleep is not part of the body's span
            body()
            torch.cuda.synchronize()
        ks = [k for k in _kernels(prof) if "sleep" not in k[2].lower()]
        if not ks:
            continue
        spans.append((ks[-1][1] - ks[0][0]) / 1e3)
        busy.append(sum(e - s for s, e, _ in ks) / 1e3)
        counts.append(len(ks))
        runs.append(ks)
        for s, e, n in ks:
            by_name[n[:70]] += (e - s) / 1e3 / iters
    top = sorted(by_name.items(), key=lambda kv: -kv[1])[:8]
    median = sorted(range(len(spans)), key=lambda i: spans[i])[len(spans) // 2]
    rows = []
    if timeline:  # (gap after the previous kernel's end us, duration us, name) of the median iteration
        ks, end = runs[median], runs[median][0][0]
        for s, e, n in ks:
            rows.append((round(s - end, 2), round(e - s, 2), n[:90]))  # profiler times are in us
            end = max(end, e)
    return dict(name=name, span_ms=spans[median], kernel_ms=sorted(busy)[len(busy) // 2],
                kernels=max(counts), top=top, timeline=rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--numel", type=int, default=256 << 20)
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--kinds", default="fp32,bf16", help="comma-separated kinds of bench_step.KINDS")
    parser.add_argument("--rows", default="torch,eager,graph,kernels",
                        help="which variants: torch (fp32/bf16 only), eager, graph, kernels")
    parser.add_argument("--timeline", action="store_true", help="print every kernel of the median iteration")
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "out")))
    args = parser.parse_args()
    rows = set(args.rows.split(","))
    device = torch.device("cuda")
    sizes = bs._sizes(args.numel)
    timer = bs.Timer(device)
    bs.init_world_one(device, tempfile.mkdtemp(prefix="profile_step_"))
    results = []
    for kind in [k for k in args.kinds.split(",") if k]:
        variants = {}
        if "torch" in rows and kind in ("fp32", "bf16"):
            variants[f"torch {kind}"] = bs.torch_variant(kind, sizes, device)
        if "eager" in rows:
            variants[f"shardamp {kind}"] = bs.shardamp_variant(kind, sizes, device)
        if "graph" in rows:
            variants[f"shardamp {kind} graph"] = bs.shardamp_variant(kind, sizes, device, graph=True)
        if "kernels" in rows:
            prep, body, _ = bs.kernels_variant(kind, sizes, device)
            variants[f"kernels {kind}"] = (prep, body)
        for name, (prep, body) in variants.items():
            results.append(profile_variant(name, prep, body, timer, args.iters, args.timeline))
            r = results[-1]
            print(f"\n{name}: device span {r['span_ms']:.3f} ms, kernels {r['kernel_ms']:.3f} ms, "
                  f"{r['kernels']} kernels, gaps {r['span_ms'] - r['kernel_ms']:.3f} ms")
            for kname, ms in r["top"]:
                print(f"    {ms:8.3f} ms  {kname}")
            for gap, dur, kname in r["timeline"]:
                print(f"    +{gap:7.2f} us {dur:9.2f} us  {kname}")
        del variants
        torch.cuda.empty_cache()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "profile_step.json").write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
