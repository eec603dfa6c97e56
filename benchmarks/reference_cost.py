"""What a failed kernel build costs: one ``DistributedFusedAdam.step()`` on the native kernels
against the pure-PyTorch reference, in two processes (``SHARDAMP_KERNELS=native`` /
``reference``), median of ``--iters`` steps over ``--layers`` x ``Linear(--width, --width)`` fp32.

    python benchmarks/reference_cost.py [--device cpu|cuda] [--threads 2]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time


def one(device: str, layers: int, width: int, iters: int) -> float:
    import torch

    from shardamp.optim import DistributedFusedAdam, kernels

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)]).to(device)
    opt = DistributedFusedAdam(model.parameters(), lr=1e-3)
    x = torch.randn(4, width, device=device)
    times = []
    for i in range(iters + 3):
        model(x).sum().backward()
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        opt.step()
        if device == "cuda":
            torch.cuda.synchronize()
        if i >= 3:
            times.append(time.perf_counter() - start)
        opt.zero_grad()
    times.sort()
    assert kernels.backend(torch.device(device)) == os.environ["SHARDAMP_KERNELS"]
    return times[len(times) // 2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        import torch

        torch.set_num_threads(args.threads)
        print(json.dumps(one(args.device, args.layers, args.width, args.iters)))
        return
    result = {}
    for backend in ("native", "reference"):
        out = subprocess.run([sys.executable, __file__, "--child", *sys.argv[1:]], check=True, capture_output=True,
                             text=True, env={**os.environ, "SHARDAMP_KERNELS": backend}).stdout
        result[backend] = json.loads(out.strip().splitlines()[-1])
    params = args.layers * (args.width * args.width + args.width)
    print(f"{params / 1e6:.1f}M fp32 params on {args.device}: native {1e3 * result['native']:.1f} ms, reference "
          f"{1e3 * result['reference']:.1f} ms per step ({result['reference'] / result['native']:.1f}x)")


if __name__ == "__main__":
    main()
