"""Tuning the CUDA step for the light-state kinds: kernels.adam_step alone, per launch shape and chunk.

For each kind of benchmarks/bench_step.py's KINDS (raw flat tensors, 64 uneven params as there), it
times the step kernel alone (no stats pass, no optimizer ops) under every launch shape
(SHARDAMP_CUDA_STEP=UxB: U vector steps of 8 elements per thread, B resident blocks per SM;
csrc/cuda/adam_step.cu) and chunk size (SHARDAMP_CUDA_CHUNK), against the kind's step bytes over
the device-to-device copy bandwidth measured in the same run. Configurations are interleaved;
each number is the median over --rounds of the per-call time of 10 back-to-back launches.

Before timing, every shape and chunk is checked bit for bit against the 2x1 shape on the same
inputs (a smaller problem, uneven segments): the per-element arithmetic must not depend on how the
work is split. The grad_stats pass is timed alone too (what the bench's "kernels" rows add).

    python benchmarks/tune_step.py --out out/         # needs a CUDA GPU
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_step as bs  # noqa: E402

# "default": SHARDAMP_CUDA_STEP and SHARDAMP_CUDA_CHUNK unset (each kind's own shape and chunk:
# csrc/cuda/adam_step.cu, optim/kernels/launch_config.py); "UxB": U vector steps per thread held in registers,
# B blocks per SM; "c2x4": loads staged through shared memory. Chunk 0: the kind's own.
# --configs overrides the list (SHAPE:CHUNK,...).
DEFAULT_CONFIGS = "default:0,2x1:8192,2x1:16384,2x3:4096,c2x4:4096,c2x4:8192"
LIGHT = ["fp32+bf16 moments", "bf16+remainders", "bf16+remainders+bf16 moments", "bf16+bf16 moments"]
# bench_step's kinds plus one it has no row for (fp32 params with bf16 grad_sync_dtype: bf16
# grads, fp32 master = param, bf16 moments; 2 + 8 + 4 + 4 B)
KINDS = dict(bs.KINDS, **{"bf16 grads+fp32 params+bf16 moments": dict(
    dtype=torch.float32, grad=torch.bfloat16, opts=bs.KINDS["fp32+bf16 moments"]["opts"], stats=2, step=18)})


def parse_configs(text: str) -> list:
    out = []
    for item in [w for w in text.split(",") if w]:
        shape, _, chunk = item.partition(":")
        out.append((shape, int(chunk or 0)))
    return out


def make_state(kind: str, sizes, device, seed: int):
    from shardamp.optim.layout import ALIGN, Segment, SegmentTable
    from shardamp.optim.kernels.reference import split_remainders

    spec = KINDS[kind]
    gdtype, opts = spec.get("grad", spec["dtype"]), spec["opts"]
    segs, start = [], 0
    for i, n in enumerate(sizes):
        segs.append(Segment(start, n, i, 0, 0))
        start = (start + n + ALIGN - 1) // ALIGN * ALIGN
    numel = start
    g = torch.Generator(device=device).manual_seed(seed)
    grad = torch.randn(numel, device=device, generator=g).mul_(1e-2).to(gdtype)
    master = torch.randn(numel, device=device, generator=g)
    m = torch.randn(numel, device=device, generator=g).mul_(1e-3).to(opts.get("exp_avg_dtype", torch.float32))
    v = torch.rand(numel, device=device, generator=g).mul_(1e-5).to(opts.get("exp_avg_sq_dtype", torch.float32))
    out = torch.zeros(numel, device=device, dtype=torch.bfloat16) if spec["dtype"] == torch.bfloat16 else None
    if opts.get("store_param_remainders"):
        out, master = split_remainders(master)
    # the step's scalars are made once: no host-to-device copy between the timed launches
    scalars = (torch.tensor([[1e-3, 0.9, 0.999, 1e-8, 0.01]], dtype=torch.float64, device=device),
               torch.full((len(sizes),), 3.0, device=device), torch.ones(len(sizes), device=device),
               torch.tensor(0.5, device=device), torch.zeros((), device=device))
    return dict(grad=grad, master=master, m=m, v=v, out=out, table=SegmentTable.build(segs, device),
                scalars=scalars)


def step(st, device):
    from shardamp.optim import kernels

    hp, steps, touched, coef, found_inf = st["scalars"]
    kernels.adam_step(st["grad"], st["master"], st["m"], st["v"], st["out"], st["table"], hp, steps, touched,
                      coef, found_inf, True, True)


def set_config(shape: str, chunk: int) -> None:
    if shape == "default":
        os.environ.pop("SHARDAMP_CUDA_STEP", None)
    else:
        os.environ["SHARDAMP_CUDA_STEP"] = shape
    if chunk:
        os.environ["SHARDAMP_CUDA_CHUNK"] = str(chunk)
    else:
        os.environ.pop("SHARDAMP_CUDA_CHUNK", None)
    from shardamp.optim import kernels

    kernels.refresh_knobs()  # the dispatcher reads the knobs once, not at every launch


def bits(t):
    return None if t is None else t.view(torch.int16 if t.element_size() == 2 else torch.int32).clone()


def check_bitwise(device, kinds: list, configs: list) -> list:
    """Every shape and chunk computes the bits of the 2x1 shape at 8192 (3 steps, uneven small
    segments): the per-element arithmetic must not depend on how the work is split."""
    sizes = [1 + (i * 7919) % 50000 for i in range(40)]
    failures = []
    for kind in kinds:
        results = {}
        for shape, chunk in [("2x1", 8192)] + [c for c in configs if c != ("2x1", 8192)]:
            set_config(shape, chunk)
            st = make_state(kind, sizes, device, seed=5)
            for _ in range(3):
                step(st, device)
            results[(shape, chunk)] = [bits(st[k]) for k in ("master", "m", "v", "out")]
        ref = results[("2x1", 8192)]  # the shape all kinds had before
        for key, got in results.items():
            same = all((a is None and b is None) or torch.equal(a, b) for a, b in zip(got, ref))
            if not same:
                failures.append(f"{kind} {key}")
    return failures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--numel", type=int, default=256 << 20)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--kinds", default=",".join(LIGHT), help=f"comma-separated, of {', '.join(KINDS)}")
    parser.add_argument("--configs", default=DEFAULT_CONFIGS, help="SHAPE:CHUNK,... (chunk 0: the kind's own)")
    parser.add_argument("--no-fp32", action="store_true", help="leave out the fp32 kind's default row")
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "out")))
    parser.add_argument("--device", default="cuda", help="cpu: a smoke run of this script (the knobs are CUDA's)")
    args = parser.parse_args()
    device = torch.device(args.device)
    timer = bs.Timer(device)
    bw = bs.copy_bandwidth(device, timer, 20)
    kinds = [k for k in args.kinds.split(",") if k]
    shapes = parse_configs(args.configs)
    failures = check_bitwise(device, kinds, shapes)
    print(f"bitwise check of every shape/chunk against 2x1: {'OK' if not failures else failures}")

    sizes = bs._sizes(args.numel)
    configs = [(k, s, c) for k in kinds for s, c in shapes] + ([] if args.no_fp32 else [("fp32", "default", 0)])
    states = {k: make_state(k, sizes, device, seed=1) for k in {c[0] for c in configs}}
    from shardamp.optim import kernels

    stats_out = torch.zeros(2, device=device)
    for kind, shape, chunk in configs:  # warm-up: chunk tables built, kernels loaded
        set_config(shape, chunk)
        step(states[kind], device)
    timer.sync()
    times = {c: [] for c in configs}
    stats_times = {k: [] for k in ("fp32", "bf16+remainders")}
    reps = 10
    for _ in range(args.rounds):
        for cfg in configs:
            kind, shape, chunk = cfg
            set_config(shape, chunk)
            st = states[kind]
            times[cfg].append(timer.time(lambda: None, lambda: [step(st, device) for _ in range(reps)]) / reps)
        for kind in stats_times:
            g = states[kind]["grad"] if kind in states else None
            if g is not None:
                stats_times[kind].append(timer.time(
                    lambda: None, lambda: [kernels.grad_stats(g, stats_out, 2.0) for _ in range(reps)]) / reps)
    os.environ.pop("SHARDAMP_CUDA_STEP", None)
    os.environ.pop("SHARDAMP_CUDA_CHUNK", None)

    rows = []
    for cfg, ts in times.items():
        kind, shape, chunk = cfg
        floor = KINDS[kind]["step"] * args.numel / bw * 1e3
        ms = statistics.median(ts)
        rows.append(dict(kind=kind, shape=shape, chunk=chunk, ms=ms, spread=max(ts) - min(ts), floor_ms=floor,
                         fraction=floor / ms))
    result = dict(device=bs._device_name(device), torch=torch.__version__, copy_bandwidth_GBps=bw / 1e9,
                  numel=args.numel, rounds=args.rounds, bitwise_failures=failures, rows=rows,
                  stats_ms={k: statistics.median(v) for k, v in stats_times.items() if v})
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "tune_step.json").write_text(json.dumps(result, indent=2))
    print(f"{result['device']}, copy bandwidth {bw / 1e9:.0f} GB/s, {args.numel >> 20}M elements, "
          f"median of {args.rounds} x {reps} back-to-back steps")
    for k, v in result["stats_ms"].items():
        print(f"grad_stats alone, {k} grads: {v:.3f} ms")
    print(f"{'kind':<38}{'shape':>6}{'chunk':>7}{'ms':>8}{'spread':>8}{'floor':>8}{'of floor':>9}")
    for r in rows:
        print(f"{r['kind']:<38}{r['shape']:>6}{r['chunk']:>7}{r['ms']:>8.3f}{r['spread']:>8.3f}{r['floor_ms']:>8.3f}"
              f"{100 * r['fraction']:>8.1f}%")


if __name__ == "__main__":
    main()
