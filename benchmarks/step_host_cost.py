"""The one-process plain step's host time taken apart: its native call and each call inside it,
against torch's fused AdamW on the same params.

On a host-bound model (the examples' MLP: the GPU finishes an iteration in well under a
millisecond) every microsecond the host spends launching is the iteration's. This times, per
call and without synchronizing inside a timed call (the queue is drained every few calls,
outside the timing):

* ``opt.step()``: shardamp's whole step after a plain backward (zero_grad, forward, backward
  untimed before each), and torch's ``AdamW(fused=True).step()`` the same way;
* ``stats_step``: the step's one native call with the arguments the step handed it (captured
  from a real step), then its parts called one by one with the same arguments:
  ``stats_cat_finish`` (the stats' concatenation and finish), ``step_scalars`` (the grad
  coefficient, the skip and the health record), ``adam_launch_all`` (the records' prepare and
  each bucket's update kernel); and ``torch._fused_adamw_`` over the same params' grads and a
  copy of their state (what torch's step launches);
* ``no-op``: a native call that does nothing (``record_function_observed``), the floor of a
  call from Python;
* ``stats_step, inside opt.step()`` and ``torch._fused_adamw_, inside step()``: each side's
  native call as its own step makes it right after a backward (timed by a wrapper on the
  attribute the step calls), where the host's caches are cold: on an H100 host 3-4x the same call
  repeated alone;
* the Python functions each side's ``opt.step()`` enters: a count that does not scatter.

Medians of ``--rounds`` interleaved rounds of ``--iters`` calls each, microseconds a call.
``--groups 2``: two param groups, weight decay on the matrices only (the frameworks' rule,
``framework_common.decay_groups``), whose norm partials the step forms too;
``--bucket-cap-mb``: smaller buckets, more of them (the per-bucket share of the host time).

    python benchmarks/step_host_cost.py --device cuda
    python benchmarks/step_host_cost.py --device cpu --groups 2 --bucket-cap-mb 0.05
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parents[1] / "examples"))
from host_iteration import sync  # noqa: E402
from shardamp.optim import DistributedFusedAdam, config, kernels  # noqa: E402


def build(device: torch.device, dim: int, depth: int):
    """The examples' MLP (``framework_common.Net``), its batch and a bf16 autocast on CUDA."""
    from framework_common import Net, loss_fn

    torch.manual_seed(0)
    model = Net(dim, depth).to(device)
    x = torch.randn(64, 16, device=device)
    y = torch.tanh(x[:, :4] * 2)
    amp = torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")

    def backward() -> None:
        with amp:
            loss = loss_fn(model(x), y)
        loss.backward()

    return model, backward


def param_groups(model: torch.nn.Module, groups: int) -> List[Dict[str, Any]]:
    """One group (weight decay 0.01 on every param), or the examples' two: decay on the matrices only."""
    from framework_common import decay_groups

    params = [p for p in model.parameters() if p.requires_grad]
    return [{"params": params, "weight_decay": 0.01}] if groups == 1 else decay_groups(model)


def timed(fn: Callable[[], None], before: Callable[[], None], device: torch.device, iters: int,
          drain_every: int, wrap: Optional[Tuple[Any, str, List[float]]] = None) -> float:
    """Median host microseconds of ``fn`` over ``iters`` calls, each after ``before`` (untimed);
    the GPU queue is drained every ``drain_every`` calls, outside the timing. ``wrap``: ``(owner,
    name, spent)``: while ``fn`` runs, ``owner.name`` is timed too, each call's microseconds
    appended to ``spent``."""
    inner = getattr(wrap[0], wrap[1]) if wrap is not None else None

    def timed_inner(*a, **k):
        t0 = time.perf_counter()
        try:
            return inner(*a, **k)
        finally:
            wrap[2].append((time.perf_counter() - t0) * 1e6)

    out: List[float] = []
    for i in range(iters):
        before()
        if wrap is not None:
            setattr(wrap[0], wrap[1], timed_inner)
        t0 = time.perf_counter()
        try:
            fn()
        finally:
            if wrap is not None:
                setattr(wrap[0], wrap[1], inner)
        out.append((time.perf_counter() - t0) * 1e6)
        if (i + 1) % drain_every == 0:
            sync(device)
    sync(device)
    return statistics.median(out)


def python_calls(fn: Callable[[], None], before: Callable[[], None], device: torch.device) -> int:
    """The Python functions ``fn`` enters (generators counted at each resumption), after
    ``before``: a count that does not scatter as timings do, where each call costs a GPU host
    about a microsecond or more."""
    return sum(1 for line in call_tree(fn, before, device) if not line.lstrip().startswith("C "))


def call_tree(fn: Callable[[], None], before: Callable[[], None], device: torch.device) -> List[str]:
    """The functions ``fn`` enters after ``before``, in order and indented by depth: Python
    functions as ``file:line name``, C functions (torch's bindings, builtins) as ``C name``; where
    a count alone does not say which calls a device adds."""
    before()
    sync(device)
    lines: List[str] = []
    depth = [0]

    def profile(frame, event, arg) -> None:
        if event == "call":
            code = frame.f_code
            lines.append(f"{'  ' * depth[0]}{Path(code.co_filename).name}:{code.co_firstlineno} {code.co_qualname}")
            depth[0] += 1
        elif event == "c_call":
            owner = getattr(arg, "__self__", None)
            owner = f"{type(owner).__name__}." if isinstance(owner, (torch.Tensor, torch._C._TensorBase)) else ""
            lines.append(f"{'  ' * depth[0]}C {owner}{getattr(arg, '__name__', arg)}")
        elif event == "return":
            depth[0] = max(0, depth[0] - 1)

    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
    sync(device)
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--groups", type=int, choices=(1, 2), default=1,
                    help="param groups: 2 puts weight decay on the matrices only (the frameworks' rule)")
    ap.add_argument("--bucket-cap-mb", type=float, default=100.0, help="the optimizer's bucket_cap_mb")
    ap.add_argument("--calls-out", default=None,
                    help="write each side's step as the tree of functions it enters (Python and C) to this file")
    args = ap.parse_args()
    device = torch.device(args.device)
    dim, depth = (2048, 8) if device.type == "cuda" else (256, 2)
    torch.set_num_threads(1) if device.type == "cpu" else None

    model, backward = build(device, dim, depth)
    params = [p for p in model.parameters() if p.requires_grad]
    # the CPU holds a complete bucket's grads where autograd left them, handed to one launch only:
    # landed copies here, so the captured call can be made again
    config.configure(copy_grads=True)
    opt = DistributedFusedAdam(param_groups(model, args.groups), lr=1e-4, bucket_cap_mb=args.bucket_cap_mb)
    ext = kernels.native_module(device)
    if ext is None or not hasattr(ext, "stats_step"):
        raise SystemExit(f"no compiled kernels for {device.type}: nothing to take apart")

    captured: Dict[str, tuple] = {}
    real = ext.stats_step

    def capture(*a):
        captured["stats_step"] = a
        return real(*a)

    ext.stats_step = capture
    try:
        for _ in range(3):
            opt.zero_grad(set_to_none=True)
            backward()
            opt.step()
    finally:
        ext.stats_step = real
    if "stats_step" not in captured:
        raise SystemExit("the step did not take the one native call (stats_step): nothing to take apart")
    args_of = list(captured["stats_step"])
    if isinstance(args_of[6], int):  # the group partials' view (older builds have none): not timed apart below
        del args_of[6]
    (parts, end, norm_type, views, touched_view, ranks_view, coef_out, base, scale, steps, skip, inv_scale, avg,
     skip_above, counters, record, record_host, spare, natives, shards, hparams, table, records) = args_of
    out = real(*captured["stats_step"])
    touched, ranks = out[3 + touched_view], (out[3 + ranks_view] if ranks_view >= 0 else None)

    # torch's fused AdamW over the same params: its state and one backward's grads
    ref_params = [p.detach().clone() for p in params]
    ref_grads = [torch.randn_like(p) for p in params]
    ref_m = [torch.zeros_like(p) for p in params]
    ref_v = [torch.zeros_like(p) for p in params]
    ref_steps = [torch.zeros((), device=device) for _ in params]  # fused: the step counts on the device
    torch_model, torch_backward = build(device, dim, depth)
    torch_opt = torch.optim.AdamW(param_groups(torch_model, args.groups), lr=1e-4, fused=device.type == "cuda")

    def shard_step_before() -> None:
        opt.zero_grad(set_to_none=True)
        backward()

    def torch_step_before() -> None:
        torch_opt.zero_grad(set_to_none=True)
        torch_backward()

    nothing = lambda: None  # noqa: E731
    sides: Dict[str, tuple] = {
        "shardamp opt.step()": (opt.step, shard_step_before),
        "torch AdamW(fused).step()": (torch_opt.step, torch_step_before),
        "stats_step (the step's one call)": (lambda: real(*captured["stats_step"]), nothing),
        "  stats_cat_finish": (lambda: ext.stats_cat_finish(parts, end, norm_type, views), nothing),
        "  step_scalars": (lambda: ext.step_scalars(coef_out, base, scale, None, 0.0, out[2], steps, touched, skip,
                                                    out[1], inv_scale, avg, skip_above, counters, record, ranks,
                                                    record_host, spare), nothing),
        # where the step's head forms the records (a buffer passed), the launches read them as formed
        "  adam_launch_all": (lambda: ext.adam_launch_all(natives, shards, hparams, touched, skip, records,
                                                          None if records is not None else table), nothing),
        "torch._fused_adamw_": (lambda: torch._fused_adamw_(
            ref_params, ref_grads, ref_m, ref_v, [], ref_steps, lr=1e-4, beta1=0.9, beta2=0.999, weight_decay=0.01,
            eps=1e-8, amsgrad=False, maximize=False), nothing),
        "no-op native call": (ext.record_function_observed, nothing),
    }
    drain = 4 if device.type == "cuda" else 1
    # each side's native call as its step makes it, right after a backward (the calls above that
    # repeat it alone run with warm caches): timed by a wrapper on the attribute the step calls
    inside = {"shardamp opt.step()": ("  stats_step, inside opt.step()", ext, "stats_step")}
    if device.type == "cuda":  # (torch's CPU AdamW here is not the fused one)
        inside["torch AdamW(fused).step()"] = ("  torch._fused_adamw_, inside step()", torch, "_fused_adamw_")
    runs: Dict[str, List[float]] = {k: [] for k in [*sides, *(v[0] for v in inside.values())]}
    names = list(sides)
    for r in range(args.rounds):
        for k in names[r % len(names):] + names[: r % len(names)]:
            fn, before = sides[k]
            if k not in inside:
                runs[k].append(timed(fn, before, device, args.iters, drain))
                continue
            row, owner, attr = inside[k]
            spent: List[float] = []
            runs[k].append(timed(fn, before, device, args.iters, drain,
                                 wrap=(owner, attr, spent)))
            runs[row].append(statistics.median(spent))
    calls = {"shardamp opt.step()": python_calls(opt.step, shard_step_before, device),
             "torch AdamW(fused).step()": python_calls(torch_opt.step, torch_step_before, device)}
    if args.calls_out:
        with open(args.calls_out, "w") as f:
            for k, (fn, before) in list(sides.items())[:2]:
                tree = call_tree(fn, before, device)
                f.write(f"== {k}: {sum(1 for t in tree if not t.lstrip().startswith('C '))} Python, "
                        f"{sum(1 for t in tree if t.lstrip().startswith('C '))} C calls\n")
                f.write("\n".join(tree) + "\n")
    label = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(f"== step_host_cost on {label}, torch {torch.__version__}: host us a call, median of {args.rounds} "
          f"interleaved rounds x {args.iters} calls ({len(params)} params, "
          f"{sum(p.numel() for p in params) / 1e6:.1f}M, {len(opt.param_groups)} group(s), "
          f"{len(opt._buckets)} bucket(s))")
    for k in runs:
        v = runs[k]
        print(f"{k:36s} {statistics.median(v):8.1f}   (rounds {min(v):.1f}-{max(v):.1f})")
    print("Python calls a step (functions entered, torch's wrapper included; the same every step):")
    for k, n in calls.items():
        print(f"{k:36s} {n:8d}")


if __name__ == "__main__":
    main()
