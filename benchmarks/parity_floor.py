"""How far torch's own AdamW implementations drift apart on the framework examples' model, next
to DistributedFusedAdam: the evidence behind framework_common's parity criterion.

    python benchmarks/parity_floor.py                          # the CUDA default's size, on the CPU, fp32
    python benchmarks/parity_floor.py --precision bf16 --steps 10
    python benchmarks/parity_floor.py --device cuda

No framework: one process (world 1), every variant trained in lockstep on the same batches (the
examples' model, data, groups, lr 1e-3, clip 0.05), each compared after some steps with torch's
default AdamW + clip_grad_norm_ by framework_common.Deviation (worst element in units of the fp32
tolerance; drift, ||diff|| / how far training moved each tensor). Variants: torch ``fused=True``,
torch with the clipping norm summed in fp64, both, shardamp, shardamp with lr x1.01 and without
clipping. Also prints how far each run's step-1 norm is from the fp64 norm.
"""
from __future__ import annotations

import argparse
import math
import os
import socket
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples"))
import framework_common as common  # noqa: E402
from shardamp.optim import DistributedFusedAdam, clip_grad_norm_

VARIANTS = ["torch", "fused", "fp64 norm", "fused + fp64 norm", "shardamp", "shardamp lr x1.01", "shardamp no clip"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--precision", choices=["fp32", "bf16"], default="fp32")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--dim", type=int, default=2048)
    p.add_argument("--depth", type=int, default=8)
    a = p.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("nccl" if a.device == "cuda" else "gloo", init_method=f"tcp://127.0.0.1:{port}",
                            rank=0, world_size=1)
    if a.device == "cuda":
        torch.cuda.set_device(0)
    else:
        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    args = argparse.Namespace(steps=a.steps, accumulate=2, batch_size=64, world_size=1, dim=a.dim, depth=a.depth,
                              precision=a.precision, max_grad_norm=0.05)
    x, y = (t.to(a.device) for t in common.data(args))
    dtype = common.autocast_dtype(a.precision)
    runs = {}
    for v in VARIANTS:
        model = common.make_model(args).to(a.device)
        lr = common.LR * (1.01 if "x1.01" in v else 1.0)
        kw = dict(lr=lr, betas=common.BETAS, eps=common.EPS)
        if v.startswith("shardamp"):
            opt = DistributedFusedAdam(common.decay_groups(model), **kw)
        else:
            opt = torch.optim.AdamW(common.decay_groups(model), **kw, **({"fused": True} if "fused" in v else {}))
        runs[v] = (model, opt, [])
    init = [p.detach().clone() for p in runs["torch"][0].parameters()]
    names = [n for n, _ in runs["torch"][0].named_parameters()]
    rtol, atol = common.TOLERANCE["fp32"]
    for s in range(a.steps):
        for v, (model, opt, norms) in runs.items():
            opt.zero_grad()
            for m in range(2):
                idx = torch.arange((2 * s + m) * 64, (2 * s + m + 1) * 64, device=a.device)
                with torch.autocast(a.device, dtype=dtype or torch.bfloat16, enabled=dtype is not None):
                    loss = common.loss_fn(model(x[idx]), y[idx]) / 2
                loss.backward()
            params = list(model.parameters())
            if s == 0 and v == "torch":  # step 1: every run has these same grads
                exact = math.sqrt(sum(float((q.grad.double() ** 2).sum()) for q in params))
            max_norm = math.inf if "no clip" in v else args.max_grad_norm
            if v.startswith("shardamp"):
                norms.append(float(clip_grad_norm_(params, max_norm)))
            else:
                norms.append(float(common._clip(params, max_norm, exact_norm="fp64" in v)))
            if s == 0 and v in ("torch", "shardamp"):
                print(f"step-1 norm, {v}: {norms[0]:.9f} (the grads' fp64 norm: {exact:.9f}, "
                      f"rel. {(norms[0] - exact) / exact:+.1e})", flush=True)
            opt.step()
        if s + 1 in (1, 2, 3, 6, 10, 20, 30, 40) or s + 1 == a.steps:
            ref = [q.detach() for q in runs["torch"][0].parameters()]
            line = [f"after step {s + 1} (grad norm {runs['torch'][2][-1]:.3f}):"]
            for v, (model, _, norms) in runs.items():
                if v != "torch":
                    d = common.Deviation(list(model.parameters()), ref, init, names, rtol, atol)
                    line.append(f"  {v:>18}: worst {d.worst:10.3f} x fp32 tolerance, drift {d.drift:.1e}, "
                                f"norm rel. {abs(norms[-1] - runs['torch'][2][-1]) / runs['torch'][2][-1]:.1e}")
            print("\n".join(line), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
