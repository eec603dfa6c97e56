"""``offload="cpu"`` at world 1 on one GPU: the largest GPT each optimizer trains under a memory cap,
the iteration time where all fit, and the offloaded step's host-link and host-memory roofline.

    python benchmarks/bench_offload.py --device cuda --out out/offload                 # all three parts
    python benchmarks/bench_offload.py --device cuda --parts roofline --layers 8 --out out/offload
    python benchmarks/bench_offload.py --device cpu --parts speed,roofline --width 64 --layers 2 \\
        --vocab 512 --seq 64 --batch 2 --sides shardamp,shardamp_offload --out out/offload_cpu   # CPU smoke

The sides (one process each, alternating; bf16 GPT params, clipping at 1.0, AdamW lr 1e-4, betas
(0.9, 0.999), eps 1e-8, weight decay 0.01):

* ``torch``: ``torch.optim.AdamW(fused=True)`` over the bf16 params (its state in bf16, as torch
  keeps it for bf16 params) and ``torch.nn.utils.clip_grad_norm_``;
* ``shardamp``: ``DistributedFusedAdam(max_grad_norm=1.0)``, fp32 master and moments on the GPU;
* ``shardamp_offload``: the same with ``offload="cpu"`` (``--offload-fraction``, default 1.0);
* ``deepspeed_offload``: DeepSpeed ZeRO-2 with ``offload_optimizer: {device: cpu, pin_memory: true}``
  (its CPU Adam), bf16, ``gradient_clipping: 1.0`` (``bench_deepspeed.ds_config``'s other settings).

The model: transformers' ``GPT2LMHeadModel`` (random init from a fixed seed, dropout 0, sdpa) of
``--width`` (4096) and ``--heads`` (32) with ``--layers`` blocks (about 0.2B params a block at
width 4096, plus 0.2B of embeddings), ``--seq`` x ``--batch`` random tokens (their own labels).

Parts (``--parts``):

* ``sizes``: under each cap of ``--caps`` (GB; ``torch.cuda.set_per_process_memory_fraction``
  emulating a smaller card: 24 and 80), each side trains ``--size-iters`` iterations at each
  ``--size-layers`` depth in turn until one fails (out of GPU memory, or shardamp's host-memory
  check; the host's memory bounds the offloaded sides): the largest depth that trained, its
  params and peak memory, and why the next one did not.
* ``speed``: at ``--layers``, every side in alternating processes (``--repeats`` rounds, each
  ``--warmup`` + ``--iters`` iterations): median ms per iteration, the paired ratio
  deepspeed_offload / shardamp_offload (> 1: shardamp faster) with its 95% t-interval
  (host_iteration.paired_ratio), and the losses (the same data and weights on every side: step 0
  equal, the largest difference over the run).
* ``roofline``: shardamp_offload at ``--layers``: the bytes of an offloaded step (grads to the
  host, params back, the CPU step's reads and writes of host memory: grad, master, moments, the
  new params), the measured bandwidths (pinned copies each way, a host-memory copy on the
  offload's CPU threads), the step's time against the time those bytes take at those bandwidths
  (the fraction of the roofline reached), and how much of backward the grad copies add.

Output: ``<out>/bench_offload.json`` and ``<out>/bench_offload.md`` (with the date, the GPU and
this command), each process's log in ``<out>/logs/``.
"""
from __future__ import annotations

import argparse
import gc
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
import bench_deepspeed as bd  # noqa: E402  (its GPT builder, DeepSpeed config and process plumbing)

SIDES = ("torch", "shardamp", "shardamp_offload", "deepspeed_offload")


# ------------------------------------------------------------------------------ one process, one side
def _model(args, device):
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(vocab_size=args.vocab, n_positions=max(1024, args.seq), n_embd=args.width, n_layer=args.layers,
                     n_head=args.heads, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False,
                     bos_token_id=args.vocab - 1, eos_token_id=args.vocab - 1)
    torch.manual_seed(0)
    with torch.device(device):
        model = GPT2LMHeadModel(cfg)
    for p in model.parameters():
        p.data = p.data.to(torch.bfloat16)
    if args.checkpointing:
        model.gradient_checkpointing_enable()
    return model.train(), cfg


def _bandwidths(device, threads: int) -> Dict[str, float]:
    """Pinned copies each way (GB/s) and a host-memory copy on ``threads`` threads (GB/s, bytes
    read plus written)."""
    import torch

    n = 1 << 28  # 1 GiB of fp32
    host = torch.empty(n, dtype=torch.float32, pin_memory=device.type == "cuda")
    out: Dict[str, float] = {}
    if device.type == "cuda":
        dev = torch.empty(n, dtype=torch.float32, device=device)
        for name, dst, src in (("d2h", host, dev), ("h2d", dev, host)):
            dst.copy_(src, non_blocking=True)
            torch.cuda.synchronize(device)
            t = time.perf_counter()
            for _ in range(3):
                dst.copy_(src, non_blocking=True)
            torch.cuda.synchronize(device)
            out[name] = 3 * n * 4 / (time.perf_counter() - t) / 1e9
        del dev
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    other = torch.empty_like(host)
    other.copy_(host)
    t = time.perf_counter()
    for _ in range(3):
        other.copy_(host)
    out["host_copy"] = 3 * 2 * n * 4 / (time.perf_counter() - t) / 1e9
    torch.set_num_threads(before)
    return out


def worker(args) -> dict:
    import torch
    import torch.distributed as dist

    device = torch.device(args.device)
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.set_device(0)
        total = torch.cuda.get_device_properties(device).total_memory
        if args.cap_gb:
            torch.cuda.set_per_process_memory_fraction(min(1.0, args.cap_gb * 1e9 / total), device)
        if args.worker == "deepspeed_offload":
            bd.ds_arch_list(torch.cuda.get_device_capability(device))
    dist.init_process_group("nccl" if cuda else "gloo", init_method="env://", rank=0, world_size=1)
    info: Dict[str, object] = dict(side=args.worker, layers=args.layers, width=args.width, cap_gb=args.cap_gb,
                                   device=torch.cuda.get_device_name(device) if cuda else "cpu", torch=torch.__version__)
    model, cfg = _model(args, device)
    info["params"] = sum(p.numel() for p in model.parameters())
    gen = torch.Generator().manual_seed(1)
    data = torch.randint(0, cfg.vocab_size, (args.data_batches, args.batch, args.seq), generator=gen).to(device)
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    hp = dict(lr=bd.LR, betas=bd.BETAS, eps=bd.EPS, weight_decay=bd.WEIGHT_DECAY)
    phases = {"backward": 0.0, "step": 0.0}
    sync = (lambda: torch.cuda.synchronize(device)) if cuda else (lambda: None)
    opt = None
    if args.worker == "deepspeed_offload":
        import deepspeed

        config = bd.ds_config(args.batch, "fused", bd.DS_BUCKET, cuda)
        config["zero_optimization"]["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
        engine, _opt, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
        info.update(deepspeed=deepspeed.__version__, optimizer=type(getattr(engine.optimizer, "optimizer", None)).__name__)

        def one(x, timed=False):
            loss = engine(input_ids=x, labels=x).loss
            engine.backward(loss)
            engine.step()
            return loss.detach()
    else:
        if args.worker == "torch":
            opt = torch.optim.AdamW(model.parameters(), fused=cuda, **hp)
        else:
            from shardamp.optim import DistributedFusedAdam

            extra = dict(offload="cpu", offload_fraction=args.offload_fraction) if args.worker == "shardamp_offload" else {}
            opt = DistributedFusedAdam(model.parameters(), max_grad_norm=bd.MAX_NORM, bucket_cap_mb=args.bucket_mb,
                                       **hp, **extra)

        def one(x, timed=False):
            opt.zero_grad(set_to_none=True)
            loss = model(input_ids=x, labels=x).loss
            if timed:
                sync()
                t = time.perf_counter()
            loss.backward()
            if args.worker == "torch":
                torch.nn.utils.clip_grad_norm_(model.parameters(), bd.MAX_NORM)
            if timed:
                sync()
                phases["backward"] += time.perf_counter() - t
                t = time.perf_counter()
            opt.step()
            if timed:
                sync()
                phases["step"] += time.perf_counter() - t
            return loss.detach()
    losses = []
    for i in range(args.warmup):
        losses.append(one(data[i % args.data_batches]))
    sync()
    gc.collect()
    gc.disable()
    t0 = time.perf_counter()
    for i in range(args.warmup, args.warmup + args.iters):
        losses.append(one(data[i % args.data_batches]))
    sync()
    ms = (time.perf_counter() - t0) * 1e3 / args.iters
    gc.enable()
    info.update(ms=ms, losses=torch.stack(losses).float().tolist(), iters=args.iters)
    if cuda:
        info["peak"] = torch.cuda.max_memory_allocated(device)
    if args.roofline and args.worker.startswith("shardamp"):
        for i in range(args.iters):  # the phases timed apart (a sync between them)
            one(data[i % args.data_batches], timed=True)
        info["phases_ms"] = {k: v * 1e3 / args.iters for k, v in phases.items()}
        host = opt._host
        shards = list(host.shards.values())
        d2h = sum(hs.grad.numel() * hs.grad.element_size() for hs in shards)
        back = [hs.out if hs.out is not None else hs.master for hs in shards]  # what returns to the GPU
        h2d = sum(t.numel() * t.element_size() for t in back)
        state = sum(hs.master.numel() * hs.master.element_size() + hs.exp_avg.numel() * hs.exp_avg.element_size()
                    + hs.exp_avg_sq.numel() * hs.exp_avg_sq.element_size() for hs in shards)
        host_bytes = d2h + 2 * state + h2d  # the CPU step reads grad + state, writes state + new params
        bw = _bandwidths(device, host.threads if shards else torch.get_num_threads())
        info.update(bytes=dict(d2h=d2h, h2d=h2d, host=host_bytes), bandwidth_gbs=bw, threads=host.threads if shards else 0,
                    memory_stats=opt.memory_stats())
    dist.destroy_process_group()
    return info


# ------------------------------------------------------------------------------ the parent
def run_side(side: str, args, tag: str, **over) -> dict:
    logs = Path(args.out) / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    result = logs / f"{tag}_{side}.json"
    result.unlink(missing_ok=True)
    opts = dict(layers=args.layers, iters=args.iters, warmup=args.warmup, cap_gb=0.0, roofline=False)
    opts.update(over)
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", side, "--device", args.device,
           "--width", str(args.width), "--heads", str(args.heads), "--vocab", str(args.vocab), "--seq", str(args.seq),
           "--batch", str(args.batch), "--layers", str(opts["layers"]), "--iters", str(opts["iters"]),
           "--warmup", str(opts["warmup"]), "--cap-gb", str(opts["cap_gb"]), "--data-batches", str(args.data_batches),
           "--bucket-mb", str(args.bucket_mb), "--offload-fraction", str(args.offload_fraction), "--result", str(result)]
    cmd += ["--roofline"] if opts["roofline"] else []
    cmd += ["--checkpointing"] if args.checkpointing else []
    t = time.monotonic()
    with (logs / f"{tag}_{side}.log").open("w") as log:
        try:
            rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=bd.child_env(
                "deepspeed" if side.startswith("deepspeed") else side), cwd=str(ROOT), timeout=args.timeout).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
    if rc == 0 and result.exists():
        return dict(json.loads(result.read_text()), wall_s=time.monotonic() - t)
    tail = (logs / f"{tag}_{side}.log").read_text(errors="replace").strip().splitlines()[-20:]
    reason = next((ln for ln in reversed(tail) if "Error" in ln or "error" in ln), tail[-1] if tail else "")
    return dict(error=f"exit {rc}: {reason.strip()[:300]}", oom="out of memory" in "\n".join(tail).lower(),
                log=str(logs / f"{tag}_{side}.log"))


def part_sizes(args, sides: List[str]) -> List[dict]:
    rows = []
    for cap in args.caps:
        for side in sides:
            best, failure = None, ""
            for layers in args.size_layers:
                r = run_side(side, args, f"size_{cap:g}gb_{layers}", layers=layers, cap_gb=cap, iters=args.size_iters,
                             warmup=1)
                if "error" in r:
                    failure = f"{layers} layers: {r['error']}"
                    break
                best = r
            rows.append(dict(cap_gb=cap, side=side, layers=best and best["layers"], params=best and best["params"],
                             peak=best and best.get("peak"), next_failure=failure))
            print(f"sizes: {cap:g} GB {side}: {rows[-1]}", flush=True)
    return rows


def part_speed(args, sides: List[str]) -> dict:
    from host_iteration import paired_ratio

    runs: Dict[str, List[dict]] = {s: [] for s in sides}
    for rep in range(args.repeats):
        for side in (sides if rep % 2 == 0 else list(reversed(sides))):
            runs[side].append(run_side(side, args, f"speed_{rep}"))
            print(f"speed {rep} {side}: {runs[side][-1].get('ms', runs[side][-1].get('error'))}", flush=True)
    out: Dict[str, object] = {}
    for side, rs in runs.items():
        ok = [r for r in rs if "error" not in r]
        out[side] = dict(ms=statistics.median(r["ms"] for r in ok) if ok else None, runs=[r.get("ms") for r in rs],
                         peak=max((r.get("peak") or 0 for r in ok), default=0), params=ok[0]["params"] if ok else None,
                         loss_first=ok[0]["losses"][0] if ok else None, errors=[r["error"] for r in rs if "error" in r])
    base = [r for r in runs.get("shardamp_offload", []) if "error" not in r]
    for side in sides:
        pairs = [(a, b) for a, b in zip(runs[side], runs.get("shardamp_offload", [])) if "error" not in a
                 and "error" not in b]
        if side != "shardamp_offload" and pairs:
            mean, lo, hi = paired_ratio([a["ms"] for a, _ in pairs], [b["ms"] for _, b in pairs])
            out[side].update(ratio_to_offloaded=mean, ratio_lo=lo, ratio_hi=hi,
                             loss_max_abs_diff=max(abs(x - y) for x, y in zip(pairs[0][0]["losses"], base[0]["losses"])))
    return out


def part_roofline(args) -> dict:
    r = run_side("shardamp_offload", args, "roofline", roofline=True)
    if "error" in r:
        return r
    bw, b, ph = r["bandwidth_gbs"], r["bytes"], r["phases_ms"]
    host_s = b["host"] / (bw["host_copy"] * 1e9)
    link_s = b["h2d"] / (bw["h2d"] * 1e9) if "h2d" in bw else 0.0
    roof_ms = 1e3 * max(host_s, link_s)
    r["roofline"] = dict(step_roofline_ms=roof_ms, step_ms=ph["step"], fraction=roof_ms / ph["step"] if ph["step"] else None,
                         d2h_ms=1e3 * b["d2h"] / (bw["d2h"] * 1e9) if "d2h" in bw else None)
    return r


def markdown(result: dict, args) -> str:
    g = lambda b: "-" if not b else f"{b / 2**30:.1f} GiB"  # noqa: E731
    lines = [f"# offload=\"cpu\" at world 1: {result['date']}, {result.get('device', '?')}",
             "", f"Command: `{result['command']}`", ""]
    if "sizes" in result:
        lines += ["## Largest GPT under a memory cap", "", "| cap | side | layers | params | peak | next size |",
                  "|---|---|---|---|---|---|"]
        for r in result["sizes"]:
            params = f"{r['params'] / 1e9:.2f}B" if r["params"] else "-"
            lines.append(f"| {r['cap_gb']:g} GB | {r['side']} | {r['layers'] or '-'} | {params} | {g(r['peak'])} | "
                         f"{r['next_failure'] or 'all fit'} |")
        lines.append("")
    if "speed" in result:
        lines += [f"## Iteration time at {args.layers} layers (width {args.width}, {args.batch} x {args.seq})", "",
                  "| side | median ms | side / shardamp_offload [95% t] | peak | loss step 0 | max loss diff to offloaded |",
                  "|---|---|---|---|---|---|"]
        for side, r in result["speed"].items():
            ratio = (f"{r['ratio_to_offloaded']:.3f} [{r['ratio_lo']:.3f}-{r['ratio_hi']:.3f}]"
                     if "ratio_to_offloaded" in r else "-")
            ms = f"{r['ms']:.1f}" if r["ms"] else f"ERROR {r['errors'][:1]}"
            diff = f"{r['loss_max_abs_diff']:.4f}" if "loss_max_abs_diff" in r else "-"
            loss = f"{r['loss_first']:.4f}" if r["loss_first"] is not None else "-"
            lines.append(f"| {side} | {ms} | {ratio} | {g(r['peak'])} | {loss} | {diff} |")
        lines.append("")
    if "roofline" in result:
        r = result["roofline"]
        if "error" in r:
            lines += ["## Roofline", "", f"ERROR {r['error']}", ""]
        else:
            b, bw, rf = r["bytes"], r["bandwidth_gbs"], r["roofline"]
            lines += ["## The offloaded step's roofline", "",
                      f"- bytes per step: {g(b['d2h'])} grads to the host, {g(b['h2d'])} params back, {g(b['host'])} "
                      f"through host memory in the CPU step ({r['threads']} threads)",
                      f"- measured: pinned copy to the host {bw.get('d2h', 0):.1f} GB/s, to the GPU {bw.get('h2d', 0):.1f}"
                      f" GB/s, host-memory copy {bw['host_copy']:.1f} GB/s",
                      f"- step: {rf['step_ms']:.1f} ms measured, {rf['step_roofline_ms']:.1f} ms at those bandwidths: "
                      f"{100 * (rf['fraction'] or 0):.0f}% of the roofline; backward {r['phases_ms']['backward']:.1f} ms "
                      f"(its grad copies alone: {rf['d2h_ms'] or 0:.1f} ms, hidden under it)", ""]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--parts", default="sizes,speed,roofline")
    ap.add_argument("--sides", default=",".join(SIDES))
    ap.add_argument("--width", type=int, default=4096)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--vocab", type=int, default=50257)
    ap.add_argument("--layers", type=int, default=4, help="depth of the speed and roofline parts (all sides fit)")
    ap.add_argument("--size-layers", default="4,8,12,16,20,24,28,32,36,40", help="depths the sizes part tries")
    ap.add_argument("--caps", default="24,80", help="GPU memory caps of the sizes part, GB")
    ap.add_argument("--size-iters", type=int, default=2)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--data-batches", type=int, default=4)
    ap.add_argument("--bucket-mb", type=float, default=100.0)
    ap.add_argument("--offload-fraction", type=float, default=1.0)
    ap.add_argument("--checkpointing", action="store_true", help="activation checkpointing (larger models fit)")
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds per process")
    ap.add_argument("--out", default="out/offload")
    ap.add_argument("--worker", choices=SIDES, help=argparse.SUPPRESS)
    ap.add_argument("--cap-gb", type=float, default=0.0, help=argparse.SUPPRESS)
    ap.add_argument("--roofline", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    args = ap.parse_args()
    bd._import_shardamp()
    if args.worker:
        Path(args.result).write_text(json.dumps(worker(args)))
        return
    args.caps = [float(c) for c in args.caps.split(",") if c]
    args.size_layers = [int(n) for n in args.size_layers.split(",") if n]
    sides = [s for s in args.sides.split(",") if s]
    if "deepspeed_offload" in sides and bd.deepspeed_importable() is not None:
        print("deepspeed is not importable: its side is left out", flush=True)
        sides.remove("deepspeed_offload")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result: Dict[str, object] = dict(date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                                     command="python " + " ".join(sys.argv), sides=sides)
    parts = args.parts.split(",")
    if "roofline" in parts:
        result["roofline"] = part_roofline(args)
        result["device"] = result["roofline"].get("device")
    if "speed" in parts:
        result["speed"] = part_speed(args, sides)
    if "sizes" in parts and args.device == "cuda":
        result["sizes"] = part_sizes(args, sides)
    (out / "bench_offload.json").write_text(json.dumps(result, indent=1))
    text = markdown(result, args)
    (out / "bench_offload.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
