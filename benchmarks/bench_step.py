"""Benchmark: the optimizer step from "grads landed" to "params updated", stats included.

In one run, side by side, over 64 params (256M elements on a GPU, 16M on a CPU):

  shardamp   DistributedFusedAdam at world 1 (a 1-rank process group), timed after grad_sync():
             fp32: ShardedGradScaler.unscale_ + opt.clip_grad_norm + scaler.step + scaler.update
             bf16: opt.clip_grad_norm + opt.step (no scaler)
  torch      what users run instead, on unsharded params:
             fp32: GradScaler.unscale_ + clip_grad_norm_ + AdamW(fused=True) step + update
             bf16: clip_grad_norm_ + AdamW(fused=True) on bf16 params
  kernels    grad_stats + adam_step on raw flat tensors through shardamp.optim.kernels
  roofline   ideal bytes over the device-to-device copy bandwidth measured in the same run
             (bytes read + written). Per element: stats read the grad once (fp32 4, bf16 2); the
             step reads the grad and reads + writes master, exp_avg, exp_avg_sq (and writes a
             separate bf16 param copy): KINDS below has every combination's count
             (fp32: 4 + 28 = 32; bf16 params with fp32 master: 2 + 28 = 30; fp32 with bf16
             moments: 4 + 20; bf16 params with remainders: 2 + 26; csrc/NOTES.md derives them)

Kinds beyond fp32/bf16 (no torch row: torch.optim has no such storage) use the constructor
options exp_avg_dtype / exp_avg_sq_dtype = bfloat16 ("bf16 moments"), "8bit" / "4bit" (blockwise
moments: 14.06 / 12.13 B per element with bf16 grads and remainders, scales included) and
store_param_remainders; beside the 8-bit kind, torchao's AdamW8bit and bitsandbytes' 8-bit AdamW
on the same tensors where importable (benchmarks/step_lowbit.py; a skipped one says why).

Variants are interleaved and each reports the median of --iters timings (CUDA events on a GPU,
perf_counter on a CPU at --threads threads). Prints a table; writes bench_step.json and, with
matplotlib, bench_step.png to --out.

On a GPU every variant is timed twice, with CUDA events around the same device work:
  host ahead   the GPU is kept busy (a sleep kernel) while the host enqueues the timed calls, as
               backward's kernels keep it busy in a training loop: the events then measure what
               the device spends from "grads landed" to "params updated" (primary number; a
               timing where the host fell behind is counted and reported);
  idle GPU     the calls start on an idle GPU, so the host's launch latency is exposed too.

    python benchmarks/bench_step.py --device cuda --out out/
    python benchmarks/bench_step.py --device cpu --out out/
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Callable, Dict, List

import torch
import torch.distributed as dist

NUM_PARAMS = 64
MAX_NORM = 1.0
_BF16_MOMENTS = dict(exp_avg_dtype=torch.bfloat16, exp_avg_sq_dtype=torch.bfloat16)
_Q8, _Q4 = (dict(exp_avg_dtype=q, exp_avg_sq_dtype=q) for q in ("8bit", "4bit"))
# name -> param/grad dtype, optimizer options, bytes per element of the stats pass and the step.
# Step bytes: grad read (4 / 2) + master read + write (fp32: 8; bf16 param + int16 remainder: 4 + 4)
# + each moment read + write (fp32: 8, bf16: 4) + a separate bf16 param written (2, when the
# master is not the param itself and not remainders).
KINDS = {
    "fp32": dict(dtype=torch.float32, opts={}, stats=4, step=4 + 8 + 8 + 8),
    "bf16": dict(dtype=torch.bfloat16, opts={}, stats=2, step=2 + 8 + 8 + 8 + 2),
    "fp32+bf16 moments": dict(dtype=torch.float32, opts=_BF16_MOMENTS, stats=4, step=4 + 8 + 4 + 4),
    "bf16+remainders": dict(dtype=torch.bfloat16, opts=dict(store_param_remainders=True), stats=2,
                            step=2 + 8 + 8 + 8),
    "bf16+remainders+bf16 moments": dict(dtype=torch.bfloat16, opts=dict(store_param_remainders=True, **_BF16_MOMENTS),
                                         stats=2, step=2 + 8 + 4 + 4),
    "bf16+bf16 moments": dict(dtype=torch.bfloat16, opts=_BF16_MOMENTS, stats=2, step=2 + 8 + 4 + 4 + 2),
    # blockwise moments: codes read + written (8-bit 1 + 1, 4-bit 0.5 + 0.5 per moment) and one fp32
    # scale per block read + written (8 B per 256 elements at 8 bits, per 128 at 4)
    "bf16+remainders+8bit moments": dict(dtype=torch.bfloat16, opts=dict(store_param_remainders=True, **_Q8),
                                         stats=2, step=2 + 8 + 2 * (2 + 8 / 256)),
    "bf16+remainders+4bit moments": dict(dtype=torch.bfloat16, opts=dict(store_param_remainders=True, **_Q4),
                                         stats=2, step=2 + 8 + 2 * (1 + 8 / 128)),
    "fp32+8bit moments": dict(dtype=torch.float32, opts=_Q8, stats=4, step=4 + 8 + 2 * (2 + 8 / 256)),
}
PEER_KIND = "bf16+remainders+8bit moments"  # the peers' 8-bit AdamW rows (step_lowbit.py) are timed beside it


def _sizes(total: int) -> List[int]:
    """64 params of uneven sizes (not multiples of 16) summing to ``total``."""
    weights = [1 + (i * 37) % 11 for i in range(NUM_PARAMS)]
    sizes = [max(1, total * w // sum(weights) - (i % 5)) for i, w in enumerate(weights)]
    sizes[-1] += total - sum(sizes)
    return sizes


class Timer:
    HEAD_START_MS = 4.0  # device time the host gets to enqueue the body in "host ahead" mode

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.host_late = 0  # host-ahead timings where the host had not finished enqueuing in time
        self.sleep_cycles = 0
        if self.cuda:  # calibrate torch.cuda._sleep (GPU clock cycles) to HEAD_START_MS
            probe = 1_000_000
            torch.cuda._sleep(probe)
            torch.cuda.synchronize()
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            torch.cuda._sleep(probe)
            b.record()
            b.synchronize()
            self.sleep_cycles = int(probe * self.HEAD_START_MS / max(a.elapsed_time(b), 1e-3))

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def time(self, prep: Callable[[], None], body: Callable[[], None], ahead: bool = False) -> float:
        """Milliseconds of ``body``, after ``prep`` has fully finished (not timed). ``ahead``
        (CUDA): a sleep kernel runs first, so the host enqueues ``body`` while the GPU is busy."""
        prep()
        self.sync()
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            if ahead:
                torch.cuda._sleep(self.sleep_cycles)
            start.record()
            body()
            end.record()
            if ahead and start.query():  # the sleep was over before the host had enqueued body
                self.host_late += 1
            end.synchronize()
            return start.elapsed_time(end)
        t0 = time.perf_counter()
        body()
        return (time.perf_counter() - t0) * 1e3


def copy_bandwidth(device: torch.device, timer: Timer, iters: int) -> float:
    """Device-to-device copy bandwidth in bytes/s, counting bytes read + written."""
    nbytes = (2 << 30) if device.type == "cuda" else (256 << 20)
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device).uniform_()
    dst = torch.empty_like(src)
    times = [timer.time(lambda: None, lambda: dst.copy_(src)) for _ in range(iters)]
    return 2 * nbytes / (statistics.median(times) / 1e3)


# ------------------------------------------------------------------------------ grad landing
def resnet50_shapes() -> List[tuple]:
    """The 161 param shapes of torchvision's ResNet-50 (25.6M elements), without torchvision."""
    shapes, inp = [(64, 3, 7, 7), (64,), (64,)], 64
    for width, blocks in ((64, 3), (128, 4), (256, 6), (512, 3)):
        for b in range(blocks):
            shapes += [(width, inp, 1, 1), (width,), (width,), (width, width, 3, 3), (width,), (width,),
                       (4 * width, width, 1, 1), (4 * width,), (4 * width,)]
            if b == 0:
                shapes += [(4 * width, inp, 1, 1), (4 * width,), (4 * width,)]
            inp = 4 * width
    return shapes + [(1000, 2048), (1000,)]


def land_rows(device: torch.device, timer: Timer, iters: int, bw: float) -> List[Dict]:
    """Backward's grad landing for ResNet-50's params (fp32 grads into an fp32 bucket buffer):
    the native byte-range copy (one batched launch per 112 grads) against torch's
    ``_foreach_copy_`` into views of the buffer; device ms from an idle GPU, the fraction of the
    copy bandwidth, and the host microseconds of one call."""
    from shardamp.optim import kernels

    native = kernels.native_module(device)
    if native is None or not hasattr(native, "land_grads"):
        return []
    params = [torch.zeros(s, device=device) for s in resnet50_shapes()]
    grads = [torch.randn_like(p) for p in params]
    offsets, off = [], 0
    for p in params:
        offsets.append(off)
        off += p.numel()
    full = torch.zeros(off, device=device)
    views = [full[o:o + p.numel()].view_as(p) for o, p in zip(offsets, params)]
    impls = {"land grads resnet50 (native)": lambda: native.land_grads(full, grads, params, offsets, False),
             "land grads resnet50 (torch foreach)": lambda: torch._foreach_copy_(views, grads)}
    rows = []
    for name, body in impls.items():
        for _ in range(3):
            body()
        ms = statistics.median(timer.time(lambda: None, body) for _ in range(iters))
        timer.sync()
        host = []
        for _ in range(iters):
            t0 = time.perf_counter()
            body()
            host.append((time.perf_counter() - t0) * 1e6)
            timer.sync()
        rows.append(dict(name=name, median_ms=ms, fraction_of_copy_bandwidth=2 * off * 4 / (ms / 1e3) / bw,
                         host_us=statistics.median(host), grads=len(params)))
    return rows


# ------------------------------------------------------------------------------ variants
def make_grads(sizes: List[int], dtype: torch.dtype, device: torch.device, seed: int) -> List[torch.Tensor]:
    g = torch.Generator(device="cpu").manual_seed(seed)
    return [(torch.randn(n, generator=g) * 1e-2).to(device=device, dtype=dtype) for n in sizes]


def torch_variant(kind: str, sizes: List[int], device: torch.device):
    """torch's own sequence over unsharded params; grads are restored before each timing."""
    dtype = torch.float32 if kind == "fp32" else torch.bfloat16
    params = [torch.nn.Parameter(torch.randn(n, device=device).to(dtype)) for n in sizes]
    saved = make_grads(sizes, dtype, device, seed=1)
    for p, g in zip(params, saved):
        p.grad = g.clone()
    opt = torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01, fused=True)
    scaler = torch.amp.GradScaler(device.type, init_scale=2.0**16) if kind == "fp32" else None
    grads = [p.grad for p in params]

    if scaler is not None:
        scaler.scale(torch.ones((), device=device))  # creates the scale tensor, as a forward would

    def prep():
        torch._foreach_copy_(grads, saved)
        if scaler is not None:
            torch._foreach_mul_(grads, scaler.get_scale())  # grads as a scaled backward leaves them

    def body():
        if scaler is not None:
            scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(params, MAX_NORM)
        if scaler is not None:
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()

    return prep, body


def shardamp_variant(kind: str, sizes: List[int], device: torch.device, graph: bool = False):
    """DistributedFusedAdam through its public API; each prep runs a backward whose grads
    are reduce-scattered (world 1) into the optimizer, then grad_sync(). With ``graph``, the
    timed body (unscale_ + clip + step + update) is one CUDA-graph replay (``capturable=True``):
    the same device work without the host's per-op launch overhead."""
    from shardamp.optim import DistributedFusedAdam
    from shardamp.scaler import ShardedGradScaler

    dtype = KINDS[kind]["dtype"]
    params = [torch.nn.Parameter(torch.randn(n, device=device).to(dtype)) for n in sizes]
    weights = make_grads(sizes, dtype, device, seed=1)  # d(sum(p * w))/dp = w
    lr = torch.tensor(1e-3, device=device) if graph else 1e-3
    opt = DistributedFusedAdam(params, lr=lr, weight_decay=0.01, bucket_cap_mb=256.0, capturable=graph,
                               **KINDS[kind]["opts"])
    scaler = ShardedGradScaler(device.type, init_scale=2.0**16) if dtype == torch.float32 else None

    def prep():
        opt.zero_grad()
        loss = sum((p * w).sum() for p, w in zip(params, weights))
        (scaler.scale(loss) if scaler is not None else loss).backward()
        opt.grad_sync()

    def body():
        if scaler is not None:
            scaler.unscale_(opt)
        opt.clip_grad_norm(MAX_NORM)
        if scaler is not None:
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()

    if not graph:
        return prep, body
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):  # warm-up before capture: kernels built, caches filled
            prep()
            body()
        prep()
    torch.cuda.current_stream().wait_stream(side)
    captured = torch.cuda.CUDAGraph()
    with torch.cuda.graph(captured):
        body()
    return prep, captured.replay


def kernels_variant(kind: str, sizes: List[int], device: torch.device):
    """grad_stats + adam_step on raw flat tensors (no optimizer bookkeeping): the kernels'
    own cost, the number the roofline is about."""
    from shardamp.optim import kernels
    from shardamp.optim.layout import ALIGN, Segment, SegmentTable

    gdtype, opts = KINDS[kind]["dtype"], KINDS[kind]["opts"]
    segs, start = [], 0
    for i, n in enumerate(sizes):
        segs.append(Segment(start, n, i, 0, 0))
        start = (start + n + ALIGN - 1) // ALIGN * ALIGN
    numel = (start + 255) // 256 * 256  # whole blocks of a blockwise moment
    table = SegmentTable.build(segs, device)
    grad = torch.randn(numel, device=device).mul_(1e-2).to(gdtype)
    master = torch.randn(numel, device=device)
    from step_lowbit import moment as _moment

    m = _moment(torch.randn(numel, device=device).mul_(1e-3), opts.get("exp_avg_dtype", torch.float32), True)
    v = _moment(torch.rand(numel, device=device).mul_(1e-5), opts.get("exp_avg_sq_dtype", torch.float32), False)
    model_out = torch.empty(numel, device=device, dtype=torch.bfloat16) if gdtype == torch.bfloat16 else None
    if opts.get("store_param_remainders"):
        from shardamp.optim.kernels.reference import split_remainders

        model_out, master = split_remainders(master)
    hparams = torch.tensor([[1e-3, 0.9, 0.999, 1e-8, 0.01]], dtype=torch.float64, device=device)
    steps = torch.ones(len(sizes), device=device)
    touched = torch.ones(len(sizes), device=device)
    coef, found_inf = torch.tensor(0.5, device=device), torch.zeros((), device=device)
    stats = torch.zeros(2, device=device)

    def body():
        stats.zero_()
        kernels.grad_stats(grad, stats, 2.0)
        kernels.adam_step(grad, master, m, v, model_out, table, hparams, steps, touched, coef, found_inf,
                          True, True)

    body()  # builds the chunk table (one host copy) outside the timings
    return (lambda: None), body, kernels.backend(device)


# ------------------------------------------------------------------------------ main
def init_world_one(device: torch.device, tmp: str) -> None:
    if dist.is_initialized():
        return
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=f"file://{tmp}/pg", rank=0, world_size=1)


def default_numel(device: torch.device) -> int:
    """256M elements on a GPU of >= 120 GiB, 128M below (every variant's tensors are held at once so
    they can be interleaved: 256M of them fill an 80 GB card), 16M on the CPU."""
    if device.type != "cuda":
        return 16 << 20
    return 256 << 20 if torch.cuda.get_device_properties(device).total_memory >= 120 << 30 else 128 << 20


def run(args) -> Dict:
    device = torch.device(args.device)
    if device.type == "cpu":
        torch.set_num_threads(args.threads)
    total = args.numel or default_numel(device)
    sizes = _sizes(total)
    timer = Timer(device)
    bw = copy_bandwidth(device, timer, args.iters)

    variants: Dict[str, tuple] = {}
    errors: Dict[str, str] = {}
    tmp = tempfile.mkdtemp(prefix="bench_step_")
    only = [w for w in args.only.split(",") if w]

    def wanted(name: str) -> bool:
        # a prefix of whole words: "kernels fp32" does not pick "kernels fp32+bf16 moments"
        return not only or any(name == w or name.startswith(w + " ") for w in only)

    for kind in KINDS:
        if kind in ("fp32", "bf16") and wanted(f"torch {kind}"):
            variants[f"torch {kind}"] = torch_variant(kind, sizes, device)
        try:
            init_world_one(device, tmp)
            if wanted(f"shardamp {kind}"):
                variants[f"shardamp {kind}"] = shardamp_variant(kind, sizes, device)
        except Exception as exc:  # report, keep the other rows
            errors[f"shardamp {kind}"] = f"{type(exc).__name__}: {exc}"
        if device.type == "cuda" and wanted(f"shardamp {kind} graph"):
            try:
                variants[f"shardamp {kind} graph"] = shardamp_variant(kind, sizes, device, graph=True)
            except Exception as exc:
                errors[f"shardamp {kind} graph"] = f"{type(exc).__name__}: {exc}"
        if wanted(f"kernels {kind}"):
            prep, body, backend = kernels_variant(kind, sizes, device)
            variants[f"kernels {kind} ({backend})"] = (prep, body)
        if kind == PEER_KIND:  # torchao's and bitsandbytes' 8-bit AdamW, where importable
            from step_lowbit import peer_variants

            peers = peer_variants(sizes, device, make_grads, MAX_NORM, lambda n: wanted(f"{n} {kind}"))
            variants.update({f"{name} {kind}": pb for name, pb in peers.items()})

    times: Dict[str, List[float]] = {name: [] for name in variants}
    idle: Dict[str, List[float]] = {name: [] for name in variants}
    for name, (prep, body) in list(variants.items()):  # warm-up: builds, caches, first-step state
        try:
            for _ in range(args.warmup):
                timer.time(prep, body)
        except Exception as exc:
            errors[name] = f"{type(exc).__name__}: {exc}"
            del variants[name], times[name], idle[name]
    for _ in range(args.iters):  # interleaved, so drift (clocks, heat) hits every variant alike
        for name, (prep, body) in variants.items():
            times[name].append(timer.time(prep, body, ahead=timer.cuda))
            if timer.cuda:
                idle[name].append(timer.time(prep, body))

    # The kernels' throughput with launches queued back to back (no host gap before each call):
    # the per-iteration timings above also pay the launch latency of an idle GPU.
    back_to_back = {}
    for name, (prep, body) in variants.items():
        if name.startswith("kernels"):
            reps = 10
            back_to_back[name] = timer.time(prep, lambda: [body() for _ in range(reps)]) / reps

    rows = []
    for name, ts in times.items():
        kind = next(k for k in sorted(KINDS, key=len, reverse=True) if f" {k}" in f" {name} ")
        ideal_ms = (KINDS[kind]["stats"] + KINDS[kind]["step"]) * total / bw * 1e3
        # On CUDA the optimizer computes the grad stats as each bucket lands, under backward, so
        # its timed region holds the step alone: report it against the step's bytes too.
        step_ms = KINDS[kind]["step"] * total / bw * 1e3
        hidden = name.startswith("shardamp") and device.type == "cuda"
        idle_ms = statistics.median(idle[name]) if idle[name] else None
        rows.append(dict(name=name, kind=kind, median_ms=statistics.median(ts), min_ms=min(ts),
                         roofline_ms=ideal_ms, fraction_of_roofline=ideal_ms / statistics.median(ts),
                         stats_hidden_under_backward=hidden, step_bytes_per_elem=KINDS[kind]["step"],
                         fraction_of_step_roofline=step_ms / statistics.median(ts) if hidden else None,
                         idle_gpu_median_ms=idle_ms,
                         idle_gpu_fraction_of_roofline=ideal_ms / idle_ms if idle_ms else None))
    for kind, spec in KINDS.items():
        ms = (spec["stats"] + spec["step"]) * total / bw * 1e3
        rows.append(dict(name=f"roofline {kind}", kind=kind, median_ms=ms, min_ms=None, roofline_ms=ms,
                         fraction_of_roofline=1.0, step_roofline_ms=spec["step"] * total / bw * 1e3,
                         step_bytes_per_elem=spec["step"]))
    land = land_rows(device, timer, args.iters, bw) if wanted("land") else []
    return dict(device=str(device), device_name=_device_name(device), numel=total, num_params=NUM_PARAMS,
                threads=args.threads if device.type == "cpu" else None, iters=args.iters,
                timing="host ahead (GPU busy while the host enqueues) + idle GPU" if timer.cuda else "perf_counter",
                host_late_timings=timer.host_late,
                copy_bandwidth_GBps=bw / 1e9, torch=torch.__version__, rows=rows, errors=errors,
                kernels_back_to_back_ms=back_to_back, land=land)


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return os.uname().machine


def report(result: Dict, out: Path) -> None:
    print(f"\n{result['device_name']}: {result['numel'] / 2**20:.0f}M elements in {result['num_params']} params, "
          f"copy bandwidth {result['copy_bandwidth_GBps']:.0f} GB/s, median of {result['iters']}")
    if result["device"].startswith("cuda"):
        print(f"device time with the host ahead (as in training); last columns: from an idle GPU. "
              f"Host-ahead timings where the host fell behind: {result['host_late_timings']}")
    print(f"{'variant':<40}{'median ms':>11}{'min ms':>10}{'vs torch':>10}{'of roofline':>13}{'idle ms':>10}{'idle %':>8}")
    medians = {r["name"]: r["median_ms"] for r in result["rows"]}
    for r in result["rows"]:
        ref = medians.get(f"torch {r['kind']}")
        speedup = f"{ref / r['median_ms']:.2f}x" if ref else "-"
        mn = f"{r['min_ms']:.3f}" if r["min_ms"] is not None else "-"
        hidden = r.get("fraction_of_step_roofline")
        extra = (f"   {100 * hidden:.1f}% of the {r['step_bytes_per_elem']} B step roofline (stats hidden under backward)"
                 if hidden else "")
        if r["name"].startswith("roofline"):
            extra = f"   step alone ({r['step_bytes_per_elem']} B/elem): {r['step_roofline_ms']:.3f} ms"
        idle_ms = r.get("idle_gpu_median_ms")
        idle_txt = f"{idle_ms:>10.3f}{100 * r['idle_gpu_fraction_of_roofline']:>7.1f}%" if idle_ms else f"{'-':>10}{'-':>8}"
        print(f"{r['name']:<40}{r['median_ms']:>11.3f}{mn:>10}{speedup:>10}{100 * r['fraction_of_roofline']:>12.1f}%"
              f"{idle_txt}{extra}")
    for name, ms in result["kernels_back_to_back_ms"].items():
        print(f"{name}, launched back to back: {ms:.3f} ms per call")
    for r in result.get("land", []):
        print(f"{r['name']:<40}{r['median_ms']:>11.3f} ms  {100 * r['fraction_of_copy_bandwidth']:.1f}% of the copy "
              f"bandwidth, host {r['host_us']:.0f} us a call ({r['grads']} grads)")
    for name, err in result["errors"].items():
        print(f"{name}: FAILED ({err})")
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_step.json").write_text(json.dumps(result, indent=2))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: skipping bench_step.png")
        return
    fig, ax = plt.subplots(figsize=(8, 4))
    names = [r["name"] for r in result["rows"]]
    ax.barh(names, [r["median_ms"] for r in result["rows"]],
            color=["tab:gray" if n.startswith("roofline") else "tab:blue" if n.startswith("shardamp")
                   else "tab:green" if n.startswith("kernels") else "tab:orange" for n in names])
    ax.invert_yaxis()
    ax.set_xlabel("ms per step (median)")
    ax.set_title(f"{result['device_name']}: {result['numel'] / 2**20:.0f}M params, stats + step")
    fig.tight_layout()
    fig.savefig(out / "bench_step.png", dpi=120)
    print(f"wrote {out / 'bench_step.json'} and {out / 'bench_step.png'}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--numel", type=int, default=0, help="total elements (default 256M on a GPU of >= 120 GiB, 128M on a smaller one, 16M on a CPU)")
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2, help="CPU threads")
    parser.add_argument("--only", default="", help="comma-separated name prefixes of the variants to run "
                        "(e.g. 'shardamp fp32 graph,kernels'); default all")
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "out")))
    args = parser.parse_args()
    result = run(args)
    report(result, args.out)
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
