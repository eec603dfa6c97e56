"""Host-overhead benchmark: whole training iterations of real models, shardamp against plain
torch at world 1, plus the pieces where a Python optimizer pays on the host.

    python benchmarks/bench_host.py --device cuda --out out/host        # GPU: every row
    python benchmarks/bench_host.py --device cpu --out out/host_cpu     # CPU smoke (small models)
    python benchmarks/bench_host.py --device cuda --only resnet50 --profile out/prof

torch = ``torch.optim.AdamW(fused=True)`` + ``torch.amp.GradScaler`` + ``clip_grad_norm_``;
shardamp = ``DistributedFusedAdam`` + ``ShardedGradScaler`` + ``opt.clip_grad_norm``. Rows:

* ``model`` rows: median iteration time (ms) of interleaved repeats (torch, shardamp, shardamp,
  torch, ...; each repeat ``--iters`` iterations, synchronized at its ends; each side built
  ``--builds`` times, pooled), speed ratio torch / shardamp (>= 1.00 means shardamp is no
  slower) with the geometric mean of the paired repeats' ratios and its 95% t-interval, the
  same over each repeat's median iteration (CUDA events after each iteration, no sync inside a
  repeat: the few iterations another process on the host slowed do not move it), and peak
  memory of each alone. Models:
  ResNet-50 channels_last fp16 in five loops, torch.compile(ResNet-18), a diffusion UNet (fp16
  and bf16), GPT-2 124M bf16, the examples' MLP in bf16 (host-bound: the
  fixed cost per step), ``many params`` (1024 x 4096). On the CPU: a small ResNet-like
  net, a small UNet and GPT, fp32 compute with the scaler still enabled, no torch.compile.
* ``backward host`` rows: perf_counter around ``loss.backward()`` (host time: the GPU runs
  behind) for plain autograd, DDP's C++ reducer and shardamp's hooks; overhead per param over
  plain autograd in microseconds. ``--world2`` adds 2 gloo CPU ranks.
* ``host-bound step`` rows: a synchronized loop of a cheap backward + unscale_ + clip + step +
  update, minus the same loop without the four; ratio torch / shardamp (speedup).

The table is printed last; everything goes to ``<out>/bench_host.json``.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Dict, List

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parents[1] / "examples"))  # gpt.py, reporting.py
from host_iteration import (PHASES, VARIANTS, has_release_switch, host_pieces, interleaved,  # noqa: E402
                            make_iteration, paired_ratio, peak_memory, sync)
from host_trace import gpu_timeline, host_syncs, host_waits, python_hotspots, runtime_calls  # noqa: E402
from host_models import ManyParams, Compiled, build_model, model_specs  # noqa: E402

from shardamp.optim import DistributedFusedAdam  # noqa: E402
from shardamp.scaler import ShardedGradScaler  # noqa: E402

def model_rows(args, device: torch.device, wanted: Callable[[str], bool]) -> List[dict]:
    rows = []
    for mname, spec in model_specs(device, args.small).items():
        for loop in spec["loops"]:
            name = f"{mname}: {loop}"
            if not wanted(name):
                continue
            compile_ = spec.get("compile") and device.type == "cuda"

            def build(impl: str, spec=spec, loop=loop, compile_=compile_, variant: str = ""):
                model = build_model(spec, device)
                run = Compiled(model) if compile_ else model
                return make_iteration(impl, run, spec["batch"], spec["loss"], loop, device, spec["amp"],
                                      variant=variant)

            sides = ["torch", "shardamp"] + [f"shardamp, {v}" for v in args.variants]
            builds = 1 if compile_ else args.builds  # a compiled build compiles again
            try:
                # two builds of one loop differ by a few percent (memory placement): pooled builds
                # average that out, though the interval, over pairs, does not fully cover it
                fns = {}
                for k in range(builds):
                    for side in sides:
                        variant = side[len("shardamp, "):] if side.startswith("shardamp, ") else ""
                        fns[f"{side}#{k}"] = build("torch" if side == "torch" else "shardamp", variant=variant)
                runs: Dict[str, List[float]] = {}
                objects: Dict[str, float] = {}
                medians: Dict[str, List[float]] = {}
                interleaved(fns, device, args.warmup, args.iters, args.repeats, runs, objects, medians)
            except Exception as exc:  # noqa: BLE001 - e.g. no compiler for torch.compile
                print(f"ERROR {name}: {type(exc).__name__}: {exc}", flush=True)
                rows.append(dict(kind="error", name=name, error=f"{type(exc).__name__}: {exc}"))
                continue
            del fns  # every build: not alive through peak_memory and the next row
            # pooled over the builds, in the same order on every side: runs[i] of two sides ran
            # back to back (same build index, same repeat)
            def pool(per_build: Dict[str, List[float]]) -> Dict[str, List[float]]:
                return {side: [t for k in range(builds) for t in per_build.get(f"{side}#{k}", [])] for side in sides}

            pooled, pooled_medians = pool(runs), pool(medians)
            ms = {side: statistics.median(v) for side, v in pooled.items() if v}
            left = {side: statistics.median([objects[f"{side}#{k}"] for k in range(builds)]) for side in ms}
            mem = {impl: None if compile_ else peak_memory(lambda impl=impl: build(impl), device)
                   for impl in ("torch", "shardamp")}
            row = dict(kind="model", name=name, builds=builds, torch_ms=ms["torch"], shardamp_ms=ms["shardamp"],
                       speed=ms["torch"] / ms["shardamp"], torch_runs=pooled["torch"], shardamp_runs=pooled["shardamp"],
                       torch_iteration_medians=pooled_medians["torch"],
                       shardamp_iteration_medians=pooled_medians["shardamp"],
                       torch_gc_objects=left["torch"], shardamp_gc_objects=left["shardamp"],
                       **{f"{impl}_peak": m and m["peak"] for impl, m in mem.items()},
                       **{f"{impl}_memory": m for impl, m in mem.items()})
            row["variants"] = {v: dict(ms=ms[f"shardamp, {v}"], runs=pooled[f"shardamp, {v}"]) for v in args.variants}
            rows.append(row)
            print(_fmt(row), flush=True)
    return rows


# ------------------------------------------------------------------------------ backward host time
IMPLS = ("torch", "ddp", "shardamp")


def backward_host(make_model: Callable[[], torch.nn.Module], forward: Callable, device: torch.device,
                  iters: int, bucket_cap_mb: float = 100.0) -> Dict[str, float]:
    """Median host microseconds of ``loss.backward()`` per impl: 'torch' (plain autograd into
    .grad), 'ddp' (DDP's reducer at this world size), 'shardamp' (DistributedFusedAdam's hooks).
    One model per impl, built alike; the impls take turns every iteration (the order rotates),
    so a drift of the machine's speed hits them all alike. ``forward(module)`` returns the loss;
    DDP and shardamp bucket at ``bucket_cap_mb`` alike."""
    runs = {}
    for impl in IMPLS:
        model = make_model()
        opt, run = None, model
        if impl == "shardamp":
            opt = DistributedFusedAdam(model.parameters(), lr=1e-4, bucket_cap_mb=bucket_cap_mb)
        elif impl == "ddp":
            ids = [device.index or 0] if device.type == "cuda" else None
            run = torch.nn.parallel.DistributedDataParallel(model, device_ids=ids, bucket_cap_mb=bucket_cap_mb)
        runs[impl] = (model, run, opt)
    times: Dict[str, List[float]] = {impl: [] for impl in IMPLS}
    zeroing: Dict[str, List[float]] = {impl: [] for impl in IMPLS}
    for i in range(iters + 3):
        k = i % len(IMPLS)
        for impl in IMPLS[k:] + IMPLS[:k]:
            model, run, opt = runs[impl]
            sync(device)
            t0 = time.perf_counter()
            if opt is not None:
                opt.zero_grad()
            else:
                model.zero_grad(set_to_none=True)
            t1 = time.perf_counter()
            loss = forward(run)
            sync(device)
            t2 = time.perf_counter()
            loss.backward()
            t3 = time.perf_counter()
            sync(device)
            if i >= 3:
                times[impl].append((t3 - t2) * 1e6)
                zeroing[impl].append((t1 - t0) * 1e6)
            if opt is not None and i % 8 == 7:
                opt.step()  # a round is consumed now and then, as in training
    out = {impl: statistics.median(t) for impl, t in times.items()}
    # the caller's thread: torch frees its grads in zero_grad, shardamp on its release thread
    out.update({f"{impl}+zero_grad": statistics.median(a + b for a, b in zip(times[impl], zeroing[impl]))
                for impl in IMPLS})
    return out


def _many_params(count: int, numel: int, device: torch.device):
    one = torch.ones((), device=device)

    def make():
        torch.manual_seed(0)
        return ManyParams(count, numel).to(device=device)

    return make, (lambda m: m(one))


def _backward_row(name: str, n: int, med: Dict[str, float]) -> dict:
    row = dict(kind="backward", name=name, params=n, torch_us=med["torch"], ddp_us=med["ddp"],
               shardamp_us=med["shardamp"], ddp_per_param_us=(med["ddp"] - med["torch"]) / n,
               shardamp_per_param_us=(med["shardamp"] - med["torch"]) / n)
    if "torch+zero_grad" in med:
        row.update({f"{impl}_with_zero_grad_us": med[f"{impl}+zero_grad"] for impl in IMPLS})
        row["shardamp_with_zero_grad_per_param_us"] = (med["shardamp+zero_grad"] - med["torch+zero_grad"]) / n
    print(_fmt(row), flush=True)
    return row


def backward_rows(args, device: torch.device, wanted) -> List[dict]:
    rows = []
    count, numel = (64, 256) if args.small else (1024, 4096)
    name = f"backward host {count}x{numel}"
    iters = args.iters * args.repeats
    if wanted(name):
        make, forward = _many_params(count, numel, device)
        rows.append(_backward_row(name, count, backward_host(make, forward, device, iters)))
    specs = model_specs(device, args.small)
    spec_name = "resnet50" if "resnet50" in specs else "small resnet"
    name = f"backward host {spec_name}"
    if wanted(name):
        spec = specs[spec_name]
        inputs, target = spec["batch"]()
        amp = spec["amp"]

        def forward(m):
            with torch.autocast(device.type, dtype=amp or torch.float32, enabled=amp is not None):
                return F.cross_entropy(m(*inputs), target)

        n = len(list(build_model(spec, device).parameters()))
        rows.append(_backward_row(name, n, backward_host(lambda: build_model(spec, device), forward, device, iters)))
    return rows


BUCKETS = 16  # the many-bucket row: the params split into this many buckets (DDP alike)


def _world2_worker(rank: int, tmp: str, count: int, numel: int, iters: int, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{tmp}/pg2", rank=rank, world_size=2)
    torch.set_num_threads(1)
    make, forward = _many_params(count, numel, torch.device("cpu"))
    res = {"one bucket": backward_host(make, forward, torch.device("cpu"), iters)}  # same order on both ranks
    small = count * numel * 4 / BUCKETS / 2**20  # MB, so that the params fill BUCKETS buckets
    res["many buckets"] = backward_host(make, forward, torch.device("cpu"), iters, bucket_cap_mb=small)
    if rank == 0:
        Path(out).write_text(json.dumps(res))
    dist.destroy_process_group()


def world2_rows(args) -> List[dict]:
    import torch.multiprocessing as mp

    count, numel = (64, 256) if args.small else (1024, 4096)
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "w2.json")
        mp.spawn(_world2_worker, args=(tmp, count, numel, args.iters * 3, out), nprocs=2, join=True)
        us = json.loads(Path(out).read_text())
    rows = [_backward_row(f"backward host {count}x{numel} world 2 gloo", count, us["one bucket"]),
            _backward_row(f"backward host {count}x{numel} world 2 gloo, {BUCKETS} buckets", count, us["many buckets"])]
    # host time a bucket adds: the many-bucket row over the one-bucket row, per extra bucket
    for impl in ("ddp", "shardamp"):
        rows[1][f"{impl}_per_bucket_us"] = (us["many buckets"][impl] - us["one bucket"][impl]) / (BUCKETS - 1)
    print(f"    host time per extra bucket: ddp {rows[1]['ddp_per_bucket_us']:+.0f} us, shardamp "
          f"{rows[1]['shardamp_per_bucket_us']:+.0f} us", flush=True)
    return rows


# ------------------------------------------------------------------------------ host-bound step
def host_step_fns(impl: str, dtype: torch.dtype, count: int, numel: int, device: torch.device):
    """(full, bare, pieces): one synchronized iteration with and without unscale_ + clip + step
    + update, and the pieces of ``full`` by name (for perf_counter around each)."""
    torch.manual_seed(0)
    model = ManyParams(count, numel).to(device=device, dtype=dtype)
    one = torch.ones((), device=device)
    params = list(model.parameters())
    scaled = dtype != torch.bfloat16  # torch's GradScaler cannot unscale bf16 grads on CUDA
    if impl == "torch":
        opt = torch.optim.AdamW(params, lr=1e-4, fused=device.type == "cuda")
        scaler = torch.amp.GradScaler(device.type, enabled=scaled)
        clip = lambda: torch.nn.utils.clip_grad_norm_(params, 1.0)  # noqa: E731
    else:
        opt = DistributedFusedAdam(params, lr=1e-4)
        scaler = ShardedGradScaler(device.type, enabled=scaled)
        clip = lambda: opt.clip_grad_norm(1.0)  # noqa: E731
    pieces = {
        "zero_grad": lambda: opt.zero_grad(),
        "forward+backward": lambda: scaler.scale(model(one)).backward(),
        "unscale_": lambda: scaler.unscale_(opt),
        "clip": clip,
        "step": lambda: scaler.step(opt),
        "update": lambda: scaler.update(),
        "synchronize": lambda: sync(device),
    }

    def full():
        for fn in pieces.values():
            fn()

    def bare():
        opt.zero_grad()
        scaler.scale(model(one)).backward()
        if impl == "shardamp":
            opt.grad_sync()  # the grads land as they would before a step
        sync(device)

    return full, bare, pieces


def step_rows(args, device: torch.device, wanted) -> List[dict]:
    rows = []
    count, numel = (32, 1024) if args.small else (161, 1 << 16)
    for dtype in (torch.float32, torch.bfloat16):
        what = "unscale_+clip+step+update" if dtype != torch.bfloat16 else "clip+step (no scaler)"
        name = f"host-bound {what} {str(dtype)[6:]} params {count}x{numel}"
        if not wanted(name):
            continue
        fns = {}
        for impl in ("torch", "shardamp"):
            fns[f"{impl} full"], fns[f"{impl} bare"], _ = host_step_fns(impl, dtype, count, numel, device)
        ms = interleaved(fns, device, args.warmup, args.iters * 2, args.repeats)
        cost = {impl: ms[f"{impl} full"] - ms[f"{impl} bare"] for impl in ("torch", "shardamp")}
        row = dict(kind="step", name=name, torch_ms=cost["torch"], shardamp_ms=cost["shardamp"],
                   speedup=cost["torch"] / cost["shardamp"] if cost["shardamp"] > 0 else float("inf"),
                   **{f"{k}_ms": v for k, v in ms.items()})
        rows.append(row)
        print(_fmt(row), flush=True)
    return rows


# ------------------------------------------------------------------------------ profile
def _lines_or_error(fn: Callable[..., List[str]], *fargs) -> List[str]:
    """``fn``'s report lines, or one line naming its error: one analysis failing must not cost
    the profile's other lines."""
    try:
        return fn(*fargs)
    except Exception as exc:  # noqa: BLE001 - reported in pieces.txt
        return [f"  failed: {type(exc).__name__}: {exc}"]


def profile(args, device: torch.device, out: Path, wanted: Callable[[str], bool]) -> None:
    """Where the time goes: torch.profiler (CPU + CUDA) tables of a few torch and shardamp
    iterations of the first model row that ``--only`` selects and of the host-bound step loop (fp32, bf16 params), and
    perf_counter around each piece of the first model's iteration (two loops) and of the
    host-bound loop; written under ``out``."""
    from torch.profiler import ProfilerActivity, profile as tprofile

    out.mkdir(parents=True, exist_ok=True)
    (out / "tables.txt").write_text("")
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    keys = ["self_cpu_time_total"] + (["self_cuda_time_total"] if device.type == "cuda" else [])

    def trace(tag: str, fn: Callable[[], None]) -> None:
        for _ in range(3):
            fn()
        sync(device)
        with tprofile(activities=acts) as prof:
            for _ in range(5):
                fn()
            sync(device)
        with (out / "tables.txt").open("a") as f:  # one file: fewer to copy off a remote machine
            for key in keys:
                f.write(f"== {tag}, sorted by {key}\n{prof.key_averages().table(sort_by=key, row_limit=60)}\n")

    specs = model_specs(device, args.small)
    mname = next((name for name in specs if wanted(name)), next(iter(specs)))  # the first --only picks
    spec = specs[mname]
    lines = []
    for loop in ("scaler+unscale_+clip", "plain step"):
        for impl in ("torch", "shardamp"):
            model = build_model(spec, device)
            one = make_iteration(impl, model, spec["batch"], spec["loss"], loop, device, spec["amp"])
            trace(f"{mname} {loop} {impl}", one)
            lines.append(f"{mname} {loop} {impl}: host syncs through torch: " + ("; ".join(host_syncs(one, device)) or "none"))
            lines += [f"{mname} {loop} {impl}: CUDA runtime calls per iteration:"] + runtime_calls(one, device)
            lines += [f"{mname} {loop} {impl}: GPU timeline:"] + _lines_or_error(gpu_timeline, one, device)
            lines += [f"{mname} {loop} {impl}: host waits on the GPU through torch.cuda:"] + _lines_or_error(
                host_waits, one, device)
            lines += [f"{mname} {loop} {impl}: Python own time, backward to update:"] + python_hotspots(one)
            pieces = host_pieces(one, args.iters * 3)
            lines.append(f"{mname} {loop} {impl}: " + "  ".join(f"{k} {v:.0f}us" for k, v in pieces.items())
                         + f"  total {sum(pieces.values()):.0f}us")
            del one, model
    count, numel = (32, 1024) if args.small else (161, 1 << 16)
    for dtype in (torch.float32, torch.bfloat16):
        for impl in ("torch", "shardamp"):
            full, _bare, pieces = host_step_fns(impl, dtype, count, numel, device)
            trace(f"step_{str(dtype)[6:]}_{impl}", full)
            lines.append(f"{str(dtype)[6:]} {impl}: host syncs through torch: " + ("; ".join(host_syncs(full, device)) or "none"))
            acc = {k: [] for k in pieces}
            for _ in range(args.iters * 3):
                for k, fn in pieces.items():
                    t0 = time.perf_counter()
                    fn()
                    acc[k].append((time.perf_counter() - t0) * 1e6)
            lines.append(f"{str(dtype)[6:]} {impl}: " + "  ".join(f"{k} {statistics.median(v):.0f}us" for k, v in acc.items()))
    (out / "pieces.txt").write_text("\n".join(lines) + "\n")
    print("\n".join(lines), flush=True)


# ------------------------------------------------------------------------------ report
def _fmt(row: dict) -> str:
    def mib(b):
        return "-" if b is None else f"{b / 2**30:.2f} GiB"

    if row["kind"] == "error":
        return f"{row['name']:<46} ERROR {row['error'][:200]}"
    if row["kind"] == "model":
        text = (f"{row['name']:<46} torch {row['torch_ms']:8.2f} ms  shardamp {row['shardamp_ms']:8.2f} ms  "
                f"speed {row['speed']:.2f}x  peak {mib(row['torch_peak'])} vs {mib(row['shardamp_peak'])}")
        if row.get("torch_runs"):  # each repeat's own ratio (the two ran back to back): the drift
            speeds = [t / s for t, s in zip(row["torch_runs"], row["shardamp_runs"])]
            mean, lo, hi = paired_ratio(row["torch_runs"], row["shardamp_runs"])
            text += (f"  ({row.get('builds', 1)} builds x repeats {min(speeds):.2f}-{max(speeds):.2f}x, "
                     f"median {statistics.median(speeds):.2f}x,"
                     f" geometric mean {mean:.3f}x [95% t {lo:.3f}-{hi:.3f}];"
                     f" objects left to the gc per iteration {row['torch_gc_objects']:.0f} vs {row['shardamp_gc_objects']:.0f})")
        if row.get("torch_iteration_medians"):  # each repeat's median iteration: what a few slowed ones do not move
            mean, lo, hi = paired_ratio(row["torch_iteration_medians"], row["shardamp_iteration_medians"])
            text += f"\n    median iteration, torch / shardamp: geometric mean {mean:.3f}x [95% t {lo:.3f}-{hi:.3f}]"
        for v, got in row.get("variants", {}).items():  # --variants: each against the default build
            mean, lo, hi = paired_ratio(got["runs"], row["shardamp_runs"])
            text += (f"\n    shardamp, {v}: {got['ms']:.2f} ms; variant / default {mean:.3f}x [95% t {lo:.3f}-{hi:.3f}]"
                     f" (> 1: the default is faster); torch / variant {row['torch_ms'] / got['ms']:.2f}x")
        for impl in ("torch", "shardamp"):  # where each side's peak is, and what outlives it
            m = row.get(f"{impl}_memory")
            if m:
                text += (f"\n    {impl:<8} peak by phase: " + ", ".join(f"{k} {mib(m[k])}" for k in PHASES)
                         + f"; left to the gc {mib(m['garbage'])}")
        return text
    if row["kind"] == "backward":
        return (f"{row['name']:<46} torch {row['torch_us']:9.0f} us  ddp {row['ddp_us']:9.0f} us  shardamp "
                f"{row['shardamp_us']:9.0f} us  per param over torch: ddp {row['ddp_per_param_us']:+.2f} us, "
                f"shardamp {row['shardamp_per_param_us']:+.2f} us"
                + (f"; with zero_grad: shardamp {row['shardamp_with_zero_grad_per_param_us']:+.2f} us"
                   if "shardamp_with_zero_grad_per_param_us" in row else ""))
    return (f"{row['name']:<46} torch {row['torch_ms']:.3f} ms  shardamp "
            f"{row['shardamp_ms']:.3f} ms  speedup {row['speedup']:.2f}x")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--out", default="out/bench_host")
    ap.add_argument("--iters", type=int, default=None, help="iterations per repeat")
    ap.add_argument("--repeats", type=int, default=None, help="interleaved repeats (median)")
    ap.add_argument("--warmup", type=int, default=None)
    ap.add_argument("--threads", type=int, default=2, help="CPU threads")
    ap.add_argument("--only", default="", help="comma-separated substrings of the row names to run")
    ap.add_argument("--profile", default="", help="write torch.profiler tables of the first model here")
    ap.add_argument("--world2", action="store_true", help="also 2 gloo CPU ranks (backward host rows)")
    ap.add_argument("--builds", type=int, default=None, help="model rows: builds of each side, pooled (CUDA 2, CPU 1)")
    ap.add_argument("--variants", default="",
                    help="model rows: also these shardamp variants, comma-separated, interleaved with the rest: "
                         + ", ".join(VARIANTS))
    ap.add_argument("--inline-free", action="store_true", help="the same as --variants inline-free")
    args = ap.parse_args()
    args.variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    if args.inline_free and "inline-free" not in args.variants:
        args.variants.append("inline-free")
    for v in args.variants:
        if v not in VARIANTS:
            ap.error(f"--variants: unknown variant {v!r}; known: {', '.join(VARIANTS)}")
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: CUDA is not available")
    if "inline-free" in args.variants and not has_release_switch(device):
        print(f"--variants inline-free: no compiled kernels with a release thread on {device.type}: left out", flush=True)
        args.variants.remove("inline-free")
    args.small = device.type == "cpu"
    args.iters = args.iters or (10 if not args.small else 2)
    args.repeats = args.repeats or (5 if not args.small else 3)
    args.builds = args.builds or (2 if not args.small else 1)
    args.warmup = args.warmup if args.warmup is not None else (5 if not args.small else 1)
    if device.type == "cpu":
        torch.set_num_threads(args.threads)
    only = [s.strip() for s in args.only.split(",") if s.strip()]

    def wanted(name: str) -> bool:
        return not only or any(s in name for s in only)

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        # world 1 over a real process group, as a new user's script under torchrun would be
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", init_method=f"file://{tmp}/pg",
                                rank=0, world_size=1)
        rows: List[dict] = []
        errors: List[str] = []

        def guarded(fn, *fargs):  # one failing part must not cost the other rows
            try:
                result = fn(*fargs)
                return result if result is not None else []
            except Exception as exc:  # noqa: BLE001 - reported in the table and the JSON
                errors.append(f"{fn.__name__}: {type(exc).__name__}: {exc}")
                print(f"ERROR {errors[-1]}", flush=True)
                return []

        if args.profile:
            guarded(profile, args, device, Path(args.profile), wanted)
        rows += guarded(backward_rows, args, device, wanted)
        rows += guarded(step_rows, args, device, wanted)
        rows += guarded(model_rows, args, device, wanted)
        dist.destroy_process_group()
    if args.world2 and wanted("world 2"):
        rows += guarded(world2_rows, args)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu ({args.threads} threads)"
    result = dict(device=name, torch=torch.__version__, date=time.strftime("%Y-%m-%d"), command=" ".join(sys.argv),
                  rows=rows, errors=errors)
    (out / "bench_host.json").write_text(json.dumps(result, indent=1))
    print(f"\n== bench_host on {name}, torch {torch.__version__}, {result['date']} ==")
    for row in rows:
        print(_fmt(row))
    for err in errors:
        print(f"ERROR {err}")
    if errors or any(r["kind"] == "error" for r in rows):
        sys.exit(1)


if __name__ == "__main__":
    main()
