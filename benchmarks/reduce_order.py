"""When each bucket's reduce-scatter starts inside backward, at world > 1: how much of backward the
reductions can overlap, with one param group and with the frameworks' decay groups.

Buckets are reduce-scattered in one fixed order (the reverse of the params' order in
``param_groups``), each as soon as it and every bucket before it are complete. For each launch
this prints how many of the model's grads had arrived when it started (a reduction that starts
after all but the last grads overlaps nothing of backward). ``one group``: the model's params in
their order; ``decay groups``: weight decay on matrices only (the transformers Trainer's rule,
``examples/framework_common.decay_groups``), which lists every bias last. CPU ranks (gloo, a
``file://`` rendezvous), the second backward of each run; no timing.

    python benchmarks/reduce_order.py --world 2 --layers 6
"""
from __future__ import annotations

import argparse
import datetime
import json
import sys
import tempfile
from pathlib import Path
from typing import Dict, List

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from framework_common import decay_groups  # noqa: E402  (the frameworks' two groups)

MODES = ("one group", "decay groups")


def _model(layers: int, width: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.Tanh()) for _ in range(layers)])


def _run(rank: int, world: int, store: str, args: argparse.Namespace, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))
    from shardamp.optim import DistributedFusedAdam
    from shardamp.optim.sync import grad_sync

    arrived: List[int] = [0]
    starts: List[int] = []
    launch = grad_sync.GradSync._launch

    def counted(self, s) -> None:  # noqa: ANN001 - GradSync._launch's own signature
        starts.append(arrived[0])
        launch(self, s)

    grad_sync.GradSync._launch = counted
    result: Dict[str, Dict[str, object]] = {}
    for mode in MODES:
        model = _model(args.layers, args.width)
        for p in model.parameters():  # registered before the optimizer's: counts a grad before it is staged
            p.register_post_accumulate_grad_hook(lambda _p: arrived.__setitem__(0, arrived[0] + 1))
        groups = decay_groups(model) if mode == "decay groups" else model.parameters()
        opt = DistributedFusedAdam(groups, lr=1e-3, bucket_cap_mb=args.bucket_cap_mb)
        x = torch.randn(4, args.width, generator=torch.Generator().manual_seed(rank))
        for _ in range(2):  # the second backward: the first one's rounds are settled
            opt.zero_grad()
            arrived[0], starts[:] = 0, []
            model(x).square().mean().backward()
            opt.step()
        result[mode] = {"grads": len(list(model.parameters())), "buckets": len(opt._buckets), "starts": list(starts)}
    grad_sync.GradSync._launch = launch
    if rank == 0:
        Path(out).write_text(json.dumps(result))
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--width", type=int, default=64)
    ap.add_argument("--bucket-cap-mb", type=float, default=0.02, help="about one layer's weight a bucket at width 64")
    ap.add_argument("--json", default="", help="write the result here too")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "result.json")
        mp.spawn(_run, args=(args.world, str(Path(tmp) / "store"), args, out), nprocs=args.world)
        result = json.loads(Path(out).read_text())
    print(f"world {args.world}, {args.layers} layers of width {args.width}, bucket_cap_mb {args.bucket_cap_mb}: "
          "grads arrived when each reduce-scatter started")
    for mode in MODES:
        r = result[mode]
        print(f"  {mode:12s} {r['buckets']} buckets, {r['grads']} grads: {r['starts']}")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
