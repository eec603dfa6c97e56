"""DeepSpeed ZeRO-2 against shardamp at world 1: whole GPT-2 training iterations in bf16 with
clipping, the two run in alternating processes on the same GPU.

    python benchmarks/bench_deepspeed.py --out out/deepspeed                          # GPT-2 124M
    python benchmarks/bench_deepspeed.py --model 124m,350m --budget 400 --out out/deepspeed
    SHARDAMP_KERNELS=reference python benchmarks/bench_deepspeed.py --device cpu --model tiny \\
        --out out/deepspeed_cpu                                                        # CPU smoke

The model: transformers' ``GPT2LMHeadModel`` built from a ``GPT2Config`` (random init, nothing
downloaded; dropout 0 so that both sides compute the same function; ``use_cache=False``; sdpa
attention, transformers' default): ``124m`` (768 wide, 12 layers, 12 heads), ``350m`` (1024, 24,
16), ``774m`` (1280, 36, 20), ``1.3b`` (2048, 24, 16: the GPT-3 XL shape; GPT-2's own XL is 1.5B),
``tiny`` (64, 2, 2, vocabulary 512: the CPU smoke). Sequence ``--seq`` (1024; tiny 64), micro batch
``--batch``, random tokens from a fixed seed (``--data-batches`` batches, cycled), the tokens
their own labels (transformers shifts them; its loss upcasts the logits to fp32). Both sides
build the model the same way on the device from the same seed and cast its params to bf16
before the engine or optimizer sees them: the same initial weights, the same data.

* **DeepSpeed**: ``deepspeed.initialize`` with ZeRO stage 2, ``bf16.enabled``,
  ``gradient_clipping: 1.0``, optimizer ``AdamW`` (lr 1e-4, betas (0.9, 0.999), eps 1e-8,
  weight decay 0.01), which is DeepSpeed's ``FusedAdam`` (``adam_w_mode``), a CUDA op it builds
  just in time on first use (``TORCH_CUDA_ARCH_LIST`` is set to the GPU's capability, 9.0 on an
  H200, where unset or not in DeepSpeed's ``X.Y`` form; ``DS_BUILD_OPS=0``;
  ``DS_SKIP_CUDA_CHECK=1``, so that its nvcc / torch CUDA version check cannot refuse a minor
  version apart), ``overlap_comm``, ``contiguous_gradients``, ``reduce_scatter``,
  ``reduce_bucket_size`` = ``allgather_bucket_size`` = 5e8 elements (``--ds-bucket``). 5e8 is
  DeepSpeed's own default for both and the value of its ZeRO-2 tutorial's config, i.e. what a
  user gets; GPT-2 124M and 350M fit in one bucket (774M and 1.3B take two and three), so
  their reduction runs once, after backward. DeepSpeed allocates two reduce buffers of that many elements up front (overlap_comm
  double-buffers them): 2 x 5e8 x 2 B = 2 GB of bf16 in its peak memory whatever the model
  size; ``--ds-bucket 5e7`` gives it shardamp's 100 MB buckets instead. ``--ds-optimizer
  torch`` uses torch's fused AdamW inside the engine instead (``torch_adam``); ``auto`` (the
  default) does that only if the FusedAdam build fails, and the table's heading says so.
* **shardamp**: ``DistributedFusedAdam(params, lr=1e-4, betas=(0.9, 0.999), eps=1e-8,
  weight_decay=0.01, adam_w_mode=True, max_grad_norm=1.0, dtype=torch.float32)`` over the bf16
  model, ``grad_sync_dtype`` / ``param_sync_dtype`` left at the param dtype (bf16),
  ``store_param_remainders=False``, ``bucket_cap_mb=100`` (its default; ``--bucket-mb``),
  ``overlap_grad_sync=True``; no scaler and no autocast. This is the arrangement of
  DeepSpeed's bf16 ZeRO-2 (``deepspeed/runtime/zero/stage_1_and_2.py``): bf16 params and grads,
  the grads reduced in bf16, an fp32 master copy of the owned params and fp32 moments, the
  clip on the global norm of the unscaled grads inside the step, then the bf16 params
  refreshed from the master (docs/memory-and-precision.md: "bf16 params, fp32 master", 2 + 4 +
  8 B per owned param; not the remainders, which DeepSpeed has no counterpart of).

Timing: each repeat is one process per side (DeepSpeed and shardamp both hook the params, so
they never share a process), one-rank NCCL group through the env rendezvous (MASTER_ADDR
127.0.0.1 and a free port), ``--warmup`` iterations, then ``--iters`` timed iterations
(forward, backward, step; ``torch.cuda.synchronize`` at both ends; Python's cyclic collector run
before and off during them, as in benchmarks/host_iteration.py). The repeats alternate
DeepSpeed, shardamp, shardamp, DeepSpeed, ... (``--repeats`` pairs). Before any timing, one
warm-up process per side builds the kernels (DeepSpeed's FusedAdam, shardamp's) into
``TORCH_EXTENSIONS_DIR`` (default ``/tmp/shardamp_ext``, as benchmarks/gpu_env.sh). Reported per
model: the median ms per iteration of each side, the geometric mean of the paired ratios
DeepSpeed / shardamp (> 1: shardamp is faster) with its 95% t-interval
(host_iteration.paired_ratio), peak memory (``torch.cuda.max_memory_allocated`` from the bf16
model and the data on the device on: the engine's or optimizer's build and every iteration; and
the timed iterations alone, ``peak_steady`` in the JSON), and the losses: that of
step 0 (the same weights on the same batch: equal on both sides), the means over the first and
the last pass over the data (``--data-batches`` iterations each: the loss should fall on both
sides alike), and the largest difference between the two sides' losses, iteration by iteration.
``--budget`` (seconds) stops starting new repeats when the next one would not fit; the models
of ``--model`` run in order, each to its repeats before the next starts. Everything goes to
``<out>/bench_deepspeed.json`` and ``<out>/bench_deepspeed.md`` (rewritten after each pair), each
process's output to ``<out>/logs/``.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
SIDES = ("deepspeed", "shardamp")
# name -> (n_embd, n_layer, n_head, vocab, default seq, default batch)
MODELS = {
    "tiny": (64, 2, 2, 512, 64, 4),
    "124m": (768, 12, 12, 50257, 1024, 8),
    "350m": (1024, 24, 16, 50257, 1024, 8),
    "774m": (1280, 36, 20, 50257, 1024, 8),
    "1.3b": (2048, 24, 16, 50257, 1024, 8),
}
LR, BETAS, EPS, WEIGHT_DECAY, MAX_NORM = 1e-4, (0.9, 0.999), 1e-8, 0.01, 1.0
DS_BUCKET = 500_000_000  # elements: DeepSpeed's default reduce / allgather bucket size
MASTER_ADDR = "127.0.0.1"


def _import_shardamp() -> None:
    """The source tree's shardamp where the package is not installed (as benchmarks/gpu_env.sh
    falls back to)."""
    try:
        import shardamp  # noqa: F401
    except ImportError:
        sys.path.insert(0, str(ROOT))


# ------------------------------------------------------------------------------ one process, one side
def ds_config(batch: int, optimizer: str, bucket: int, cuda: bool) -> dict:
    params = dict(lr=LR, betas=list(BETAS), eps=EPS, weight_decay=WEIGHT_DECAY)
    if optimizer == "torch":  # torch.optim.AdamW inside the engine (fused on CUDA)
        params.update(torch_adam=True, fused=cuda)
    return {
        "train_batch_size": batch,
        "train_micro_batch_size_per_gpu": batch,
        "gradient_accumulation_steps": 1,
        "bf16": {"enabled": True},
        "gradient_clipping": MAX_NORM,
        "optimizer": {"type": "AdamW", "params": params},
        "zero_optimization": {
            "stage": 2,
            "overlap_comm": True,
            "contiguous_gradients": True,
            "reduce_scatter": True,
            "reduce_bucket_size": bucket,
            "allgather_bucket_size": bucket,
        },
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }


def ds_arch_list(capability) -> str:
    """``TORCH_CUDA_ARCH_LIST`` for DeepSpeed's just-in-time FusedAdam build: the GPU's own
    capability ("9.0" on an H200) where unset, or where set to what DeepSpeed's builder cannot
    parse: it reads each entry as ``X.Y`` or ``X.Y+PTX`` (``int`` of the minor), so an image-wide
    ``9.0a`` (set so on the H200 of docs/performance.md's kernel builds) would fail its build."""
    import re

    current = os.environ.get("TORCH_CUDA_ARCH_LIST", "").strip()
    entries = [e for e in re.split(r"[;\s]+", current) if e]
    if not entries or not all(re.fullmatch(r"\d+\.\d+(\+PTX)?", e) for e in entries):
        os.environ["TORCH_CUDA_ARCH_LIST"] = "{}.{}".format(*capability)
        if current:
            print(f"TORCH_CUDA_ARCH_LIST={current!r} is not of DeepSpeed's X.Y form: "
                  f"{os.environ['TORCH_CUDA_ARCH_LIST']} for its FusedAdam", flush=True)
    return os.environ["TORCH_CUDA_ARCH_LIST"]


def build_model(name: str, seq: int, device):
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    width, layers, heads, vocab, _, _ = MODELS[name]
    cfg = GPT2Config(vocab_size=vocab, n_positions=max(1024, seq), n_embd=width, n_layer=layers, n_head=heads,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False,
                     bos_token_id=vocab - 1, eos_token_id=vocab - 1)
    torch.manual_seed(0)
    with torch.device(device):
        model = GPT2LMHeadModel(cfg)
    for p in model.parameters():  # params only, as DeepSpeed's bf16 cast (GPT-2 has no buffers)
        p.data = p.data.to(torch.bfloat16)
    return model.train(), cfg


def worker(args) -> dict:
    t_start = time.perf_counter()
    import torch
    import torch.distributed as dist

    device = torch.device(args.device)
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.set_device(device.index or 0)
        if args.worker == "deepspeed":
            ds_arch_list(torch.cuda.get_device_capability(device))
    else:
        torch.set_num_threads(args.threads)
    dist.init_process_group("nccl" if cuda else "gloo", init_method="env://", rank=0, world_size=1)
    import transformers

    info: Dict[str, object] = dict(side=args.worker, model=args.model, device=torch.cuda.get_device_name(device)
                                   if cuda else f"cpu ({args.threads} threads)", torch=torch.__version__,
                                   transformers=transformers.__version__, pid=os.getpid())
    if args.worker == "deepspeed":
        import deepspeed

        info["deepspeed"] = deepspeed.__version__
    else:
        _import_shardamp()
        from shardamp.optim import DistributedFusedAdam, kernels
    t_import = time.perf_counter()

    model, cfg = build_model(args.model, args.seq, device)
    info["params"] = sum(p.numel() for p in model.parameters())
    info["attn_implementation"] = getattr(cfg, "_attn_implementation", None)
    gen = torch.Generator().manual_seed(1)
    data = torch.randint(0, cfg.vocab_size, (args.data_batches, args.batch, args.seq), generator=gen).to(device)
    if cuda:  # the peaks count from here: the bf16 model and the data are alike on both sides
        torch.cuda.synchronize(device)
        info["model_bytes"] = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)

    if args.worker == "deepspeed":
        config = ds_config(args.batch, args.ds_optimizer, args.ds_bucket, cuda)
        engine, _opt, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)

        def one(x):
            loss = engine(input_ids=x, labels=x).loss
            engine.backward(loss)
            engine.step()
            return loss.detach()

        inner = getattr(engine.optimizer, "optimizer", None)
        info.update(ds_config=config, zero_stage=engine.zero_optimization_stage(), bf16=engine.bfloat16_enabled(),
                    zero_optimizer=type(engine.optimizer).__name__,
                    optimizer=f"{type(inner).__module__}.{type(inner).__name__}",
                    param_dtype=str(next(engine.module.parameters()).dtype),
                    arch_list=os.environ.get("TORCH_CUDA_ARCH_LIST"),
                    reduce_buffers_bytes=(2 if config["zero_optimization"]["overlap_comm"] else 1) * args.ds_bucket * 2)
    else:
        opt = DistributedFusedAdam(model.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY,
                                   adam_w_mode=True, max_grad_norm=MAX_NORM, dtype=torch.float32,
                                   bucket_cap_mb=args.bucket_mb, overlap_grad_sync=True)

        def one(x):
            opt.zero_grad(set_to_none=True)
            loss = model(input_ids=x, labels=x).loss
            loss.backward()
            opt.step()
            return loss.detach()

        info.update(optimizer=(f"DistributedFusedAdam(dtype=float32, max_grad_norm={MAX_NORM}, adam_w_mode=True, "
                               f"bucket_cap_mb={args.bucket_mb:g})"),
                    param_dtype=str(next(model.parameters()).dtype))
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    sync()
    t_init = time.perf_counter()
    if cuda:
        info["allocated_after_init"] = torch.cuda.memory_allocated(device)

    losses = []
    n = args.data_batches
    for i in range(args.warmup):
        losses.append(one(data[i % n]))
    sync()
    if cuda:
        peak_before = torch.cuda.max_memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
    gc.collect()
    was = gc.isenabled()
    gc.disable()
    t0 = time.perf_counter()
    for i in range(args.warmup, args.warmup + args.iters):
        losses.append(one(data[i % n]))
    sync()
    t1 = time.perf_counter()
    if was:
        gc.enable()
    values = torch.stack(losses).float().tolist()
    info.update(ms=(t1 - t0) * 1e3 / args.iters, iters=args.iters, warmup=args.warmup, losses=values,
                loss_first=values[0], loss_first_pass=statistics.fmean(values[:n]),
                loss_last=statistics.fmean(values[-n:]),
                tokens_per_s=args.batch * args.seq * args.iters / (t1 - t0),
                seconds=dict(imports=t_import - t_start, build=t_init - t_import, run=time.perf_counter() - t_init))
    if cuda:
        steady = torch.cuda.max_memory_allocated(device)
        info.update(peak_steady=steady, peak=max(peak_before, steady))
    if args.worker == "shardamp":
        info["kernels"] = kernels.backend(device)
        info["memory_stats"] = {k: v for k, v in opt.memory_stats().items() if isinstance(v, (int, float))}
    dist.destroy_process_group()
    return info


# ------------------------------------------------------------------------------ the parent: alternate processes
def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((MASTER_ADDR, 0))
        return s.getsockname()[1]


def child_env(side: str) -> Dict[str, str]:
    env = dict(os.environ, MASTER_ADDR=MASTER_ADDR, MASTER_PORT=str(free_port()), RANK="0", LOCAL_RANK="0",
               WORLD_SIZE="1", LOCAL_WORLD_SIZE="1", PYTHONUNBUFFERED="1")
    env.setdefault("TORCH_EXTENSIONS_DIR", "/tmp/shardamp_ext")
    if side == "deepspeed":
        env.setdefault("DS_BUILD_OPS", "0")
        env.setdefault("DS_SKIP_CUDA_CHECK", "1")
    return env


def spawn(side: str, model: str, args, tag: str, timeout: float, **over) -> subprocess.Popen:
    """Start one worker process; ``.result_path`` / ``.log_path`` / ``.timeout`` ride along."""
    logs = Path(args.out) / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    result = logs / f"{tag}_{side}.json"
    result.unlink(missing_ok=True)
    opts = dict(seq=args.seq, batch=args.batch, iters=args.iters, warmup=args.warmup, ds_optimizer=args.ds_optimizer)
    opts.update(over)
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", side, "--model", model, "--device", args.device,
           "--seq", str(opts["seq"]), "--batch", str(opts["batch"]), "--iters", str(opts["iters"]),
           "--warmup", str(opts["warmup"]), "--data-batches", str(args.data_batches),
           "--ds-optimizer", opts["ds_optimizer"], "--ds-bucket", str(args.ds_bucket), "--bucket-mb", str(args.bucket_mb),
           "--threads", str(args.threads), "--result", str(result)]
    log = (logs / f"{tag}_{side}.log").open("w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=child_env(side), cwd=str(ROOT))
    log.close()
    proc.result_path, proc.log_path, proc.timeout, proc.started = result, logs / f"{tag}_{side}.log", timeout, time.monotonic()
    return proc


def finish(proc: subprocess.Popen) -> dict:
    """The worker's result, or ``{"error": ...}`` with the tail of its log."""
    try:
        rc = proc.wait(timeout=max(proc.timeout, 1))
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        rc = "timeout"
    wall = time.monotonic() - proc.started
    if rc == 0 and proc.result_path.exists():
        out = json.loads(proc.result_path.read_text())
        out["wall_s"] = wall
        return out
    tail = proc.log_path.read_text(errors="replace").strip().splitlines()[-25:]
    err = next((line for line in reversed(tail) if "Error" in line or "error" in line), tail[-1] if tail else "")
    return dict(error=f"exit {rc} after {wall:.0f} s: {err.strip()[:300]}", log=str(proc.log_path), log_tail=tail,
                wall_s=wall)


def run_one(side: str, model: str, args, tag: str, timeout: float, **over) -> dict:
    return finish(spawn(side, model, args, tag, timeout, **over))


def deepspeed_importable() -> Optional[str]:
    """None if a ``deepspeed`` package is on the path (importing it is left to the warm-up
    process: it takes seconds), else why not."""
    import importlib.util

    return None if importlib.util.find_spec("deepspeed") is not None else "no module named 'deepspeed'"


def warm_up(args, sides: List[str], left) -> Dict[str, dict]:
    """One short process per side on the tiny model, concurrently on a GPU: builds DeepSpeed's
    FusedAdam and shardamp's kernels before anything is timed. With ``--ds-optimizer auto``
    a failed FusedAdam build switches DeepSpeed to torch's AdamW (``args.ds_optimizer``)."""
    over = dict(seq=64, batch=2, iters=1, warmup=1)
    ds_opt = "fused" if args.ds_optimizer == "auto" and args.device != "cpu" else (
        "torch" if args.ds_optimizer == "auto" else args.ds_optimizer)
    procs = {}
    for side in sides:
        procs[side] = spawn(side, "tiny", args, "warmup", left(), ds_optimizer=ds_opt, **over)
        if args.device == "cpu":  # two cores: one at a time
            procs[side] = finish(procs[side])
    res = {side: p if isinstance(p, dict) else finish(p) for side, p in procs.items()}
    if "deepspeed" in res and "error" in res["deepspeed"] and args.ds_optimizer == "auto" and ds_opt == "fused":
        print(f"warm-up: DeepSpeed with its FusedAdam failed ({res['deepspeed']['error']}); trying torch's AdamW "
              "inside the engine (--ds-optimizer torch)", flush=True)
        args.ds_optimizer_note = f"FusedAdam failed: {res['deepspeed']['error']}"
        ds_opt = "torch"
        res["deepspeed"] = run_one("deepspeed", "tiny", args, "warmup_torch_adam", left(), ds_optimizer=ds_opt, **over)
    args.ds_optimizer = ds_opt
    for side, r in res.items():
        print(f"warm-up {side}: " + (f"ERROR {r['error']} (log {r['log']})" if "error" in r else
                                      f"ok in {r['wall_s']:.0f} s ({r.get('optimizer')}"
                                      + (f", kernels {r['kernels']}" if "kernels" in r else "") + ")"), flush=True)
    return res


def summarize(model: str, runs: Dict[str, List[dict]]) -> dict:
    _import_shardamp()
    sys.path.insert(0, str(HERE))
    from host_iteration import paired_ratio

    ok = {side: [r for r in runs[side] if "error" not in r] for side in runs}
    row = dict(model=model, pairs=min((len(v) for v in ok.values()), default=0),
               errors=[r["error"] for side in runs for r in runs[side] if "error" in r])
    for side, rs in ok.items():
        if not rs:
            continue
        row[side] = dict(ms=statistics.median(r["ms"] for r in rs), runs=[r["ms"] for r in rs],
                         peak=max(r.get("peak") or 0 for r in rs) or None,
                         peak_steady=max(r.get("peak_steady") or 0 for r in rs) or None,
                         loss_first=statistics.median(r["loss_first"] for r in rs),
                         loss_first_pass=statistics.median(r["loss_first_pass"] for r in rs),
                         loss_last=statistics.median(r["loss_last"] for r in rs),
                         tokens_per_s=statistics.median(r["tokens_per_s"] for r in rs), optimizer=rs[0].get("optimizer"))
        row[side].update({k: rs[0][k] for k in ("params", "device", "torch", "transformers", "deepspeed", "kernels",
                                                "memory_stats", "reduce_buffers_bytes", "attn_implementation",
                                                "zero_optimizer", "zero_stage", "param_dtype", "ds_config")
                          if k in rs[0]})
    # pairs whose two processes both finished, in the order they ran
    pairs = [(a, b) for a, b in zip(runs.get("deepspeed", []), runs.get("shardamp", []))
             if "error" not in a and "error" not in b]
    if pairs:
        mean, lo, hi = paired_ratio([a["ms"] for a, _ in pairs], [b["ms"] for _, b in pairs])
        row.update(ratio=mean, ratio_lo=lo, ratio_hi=hi, ratios=[a["ms"] / b["ms"] for a, b in pairs])
        a, b = pairs[0]
        row["loss_max_abs_diff"] = max(abs(x - y) for x, y in zip(a["losses"], b["losses"]))
    return row


def model_row(model: str, runs: Dict[str, List[dict]], seq: int, batch: int, meta: dict) -> dict:
    """The model's row from the runs so far; the versions and the device into ``meta``."""
    row = summarize(model, runs)
    row.update(seq=seq, batch=batch)
    for side in runs:
        for k in ("device", "torch", "transformers", "deepspeed", "kernels"):
            if k in row.get(side, {}):
                meta.setdefault(k, row[side][k])
        if "reduce_buffers_bytes" in row.get(side, {}):
            meta["ds_reduce_buffers_bytes"] = row[side]["reduce_buffers_bytes"]
    return row


def _gib(b) -> str:
    return "-" if not b else f"{b / 2**30:.2f} GiB"


def table(rows: List[dict], meta: dict) -> str:
    head = ("| model | batch x seq | DeepSpeed ms | shardamp ms | DeepSpeed / shardamp [95% t] | pairs | peak DeepSpeed "
            "| peak shardamp | loss step 0 (DS / sa) | loss first -> last pass, DS | same, shardamp | max loss diff |")
    lines = [f"GPT-2 bf16, clip 1.0, AdamW at world 1 on {meta.get('device', '?')}; torch {meta.get('torch', '?')}, "
             f"DeepSpeed {meta.get('deepspeed', '-')}, transformers {meta.get('transformers', '?')}; {meta['date']}; "
             f"DeepSpeed optimizer: {meta.get('ds_optimizer_used', '?')}; shardamp kernels: {meta.get('kernels', '-')}",
             "", head, "|" + "---|" * 12]
    for r in rows:
        ds, sa = r.get("deepspeed", {}), r.get("shardamp", {})

        def ms(s):
            return f"{s['ms']:.2f}" if s else "-"

        ratio = (f"{r['ratio']:.3f} [{r['ratio_lo']:.3f}-{r['ratio_hi']:.3f}]" if "ratio" in r else "-")
        def loss(s, key):
            return f"{s[key]:.4f}" if s else "-"

        def passes(s):
            return f"{s['loss_first_pass']:.4f} -> {s['loss_last']:.4f}" if s else "-"

        lf = f"{loss(ds, 'loss_first')} / {loss(sa, 'loss_first')}"
        diff = f"{r['loss_max_abs_diff']:.4f}" if "loss_max_abs_diff" in r else "-"
        lines.append(f"| {r['model']} | {r['batch']} x {r['seq']} | {ms(ds)} | {ms(sa)} | {ratio} | {r['pairs']} | "
                     f"{_gib(ds.get('peak'))} | {_gib(sa.get('peak'))} | {lf} | {passes(ds)} | {passes(sa)} | {diff} |")
    lines.append("")
    lines.append("Ratio > 1: shardamp is faster (geometric mean of the pairs' ratios). Peak: max_memory_allocated from "
                 "the bf16 model on the device on (engine or optimizer build, all iterations); DeepSpeed's includes its "
                 "two reduce buffers "
                 f"({_gib(meta.get('ds_reduce_buffers_bytes'))}). Loss step 0: the same weights on the same batch; "
                 "first / last pass: the mean over the first / last pass over the data (--data-batches iterations); "
                 "max loss diff: over all iterations of the first pair.")
    for r in rows:
        for e in r.get("errors", []):
            lines.append(f"- {r['model']}: ERROR {e}")
    notes = list(meta.get("notes", []))
    if meta.get("kernels") == "reference":
        notes.append("shardamp ran its pure-PyTorch reference kernels (no native build here): its times are not "
                     "those of the library")
    if str(meta.get("device", "")).startswith("cpu"):
        notes.append("--device cpu: a smoke run of the script, not a measurement")
    for note in notes:
        lines.append(f"- {note}")
    return "\n".join(lines) + "\n"


def write(out: Path, rows: List[dict], meta: dict) -> str:
    text = table(rows, meta)
    (out / "bench_deepspeed.json").write_text(json.dumps(dict(meta, rows=rows), indent=1))
    (out / "bench_deepspeed.md").write_text(text)
    return text


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--model", default="124m",
                    help=f"one or several (comma-separated, run in order) of {', '.join(MODELS)}")
    ap.add_argument("--seq", type=int, default=None, help="sequence length (default 1024; tiny 64)")
    ap.add_argument("--batch", type=int, default=None, help="micro batch (default 8; tiny 4)")
    ap.add_argument("--iters", type=int, default=30, help="timed iterations per process")
    ap.add_argument("--warmup", type=int, default=5, help="iterations before the timed ones, per process")
    ap.add_argument("--repeats", type=int, default=3, help="pairs of processes (DeepSpeed, shardamp) per model")
    ap.add_argument("--data-batches", type=int, default=4, help="distinct random batches, cycled")
    ap.add_argument("--budget", type=float, default=0, help="seconds for the whole run, warm-up build included (0: none)")
    ap.add_argument("--sides", default="deepspeed,shardamp", help="which sides run (comma-separated)")
    ap.add_argument("--ds-optimizer", default="auto", choices=["auto", "fused", "torch"],
                    help="DeepSpeed's FusedAdam, torch's AdamW inside the engine, or FusedAdam falling back to torch's")
    ap.add_argument("--ds-bucket", type=lambda v: int(float(v)), default=DS_BUCKET,
                    help="DeepSpeed's reduce / allgather bucket size in elements (5e8)")
    ap.add_argument("--bucket-mb", type=float, default=100.0, help="shardamp's bucket_cap_mb")
    ap.add_argument("--threads", type=int, default=2, help="CPU threads (--device cpu)")
    ap.add_argument("--no-warmup-build", action="store_true", help="skip the warm-up processes (kernels already built)")
    ap.add_argument("--out", default="out/deepspeed")
    ap.add_argument("--worker", choices=SIDES, help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    args = ap.parse_args()

    models = [m.strip() for m in args.model.split(",") if m.strip()]
    bad = [m for m in models if m not in MODELS]
    if bad or not models:
        ap.error(f"--model: {', '.join(bad) or 'none'} not among {', '.join(MODELS)}")
    if args.worker:
        defaults = MODELS[models[0]]
        args.model = models[0]
        args.seq, args.batch = args.seq or defaults[4], args.batch or defaults[5]
        Path(args.result).write_text(json.dumps(worker(args)))
        return

    sides = [s.strip() for s in args.sides.split(",") if s.strip()]
    if not sides or any(s not in SIDES for s in sides):
        ap.error(f"--sides: a comma-separated subset of {', '.join(SIDES)}")
    if args.iters < 1 or args.repeats < 1 or args.data_batches < 1 or args.warmup < 0:
        ap.error("--iters, --repeats, --data-batches must be >= 1, --warmup >= 0")
    started = time.monotonic()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    def left() -> float:  # seconds a process may take: what is left of the budget
        return max(args.budget - (time.monotonic() - started), 10) if args.budget else 3600

    meta = dict(date=time.strftime("%Y-%m-%d"), command=" ".join([Path(sys.executable).name] + sys.argv), notes=[],
                lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY, max_grad_norm=MAX_NORM, ds_bucket=args.ds_bucket,
                shardamp_bucket_mb=args.bucket_mb, ds_optimizer_asked=args.ds_optimizer)
    if "deepspeed" in sides:
        why = deepspeed_importable()
        if why is not None:
            note = (f"DeepSpeed is not importable here ({why}): its side is skipped. On a machine without network, "
                    "install the wheels of .whl/ first (benchmarks/README.md)")
            print(note, flush=True)
            meta["notes"].append(note)
            sides.remove("deepspeed")
    if not sides:
        write(out, [], meta)
        sys.exit(1)
    if not args.no_warmup_build:
        warm = warm_up(args, sides, left)
        for side, r in warm.items():
            if "error" in r:
                meta["notes"].append(f"warm-up {side}: {r['error']} (log {r['log']})")
                sides.remove(side)
        if not sides:
            write(out, [], meta)
            sys.exit(1)
    elif args.ds_optimizer == "auto":
        args.ds_optimizer = "fused" if args.device == "cuda" else "torch"
    meta["ds_optimizer_used"] = ("-" if "deepspeed" not in sides else "DeepSpeed FusedAdam" if args.ds_optimizer == "fused"
                                 else "torch.optim.AdamW" + (" (fused)" if args.device == "cuda" else "") + " inside the engine")
    if getattr(args, "ds_optimizer_note", None):
        meta["notes"].append(args.ds_optimizer_note)
    print(f"build done at {time.monotonic() - started:.0f} s; sides: {', '.join(sides)}", flush=True)

    rows: List[dict] = []
    pair_s: Optional[float] = None  # seconds the last pair took
    stop = False
    for mi, model in enumerate(models):
        seq, batch = args.seq or MODELS[model][4], args.batch or MODELS[model][5]
        runs: Dict[str, List[dict]] = {side: [] for side in sides}
        for rep in range(args.repeats):
            if args.budget and pair_s is not None:  # the very first pair runs (its processes get what is left)
                need = pair_s * (1.0 if rep else 1.5)  # a bigger model's first pair: a margin
                rest = args.budget - (time.monotonic() - started)
                if rest < need:
                    note = (f"{model}: budget: {rest:.0f} s left, a pair needs ~{need:.0f} s: stopped after "
                            f"{rep} of {args.repeats} pairs" + ("; later models not run" if mi + 1 < len(models) else ""))
                    print(note, flush=True)
                    meta["notes"].append(note)
                    stop = True
                    break
            t0 = time.monotonic()
            order = sides if rep % 2 == 0 else sides[::-1]
            for side in order:
                runs[side].append(run_one(side, model, args, f"{model}_{rep}", left(), seq=seq, batch=batch))
            pair_s = time.monotonic() - t0
            msg = [f"{model} pair {rep + 1}/{args.repeats} ({pair_s:.0f} s):"]
            for side in sides:
                r = runs[side][-1]
                msg.append(f"{side} ERROR {r['error']}" if "error" in r else
                           f"{side} {r['ms']:.2f} ms loss {r['loss_first_pass']:.4f} -> {r['loss_last']:.4f}"
                           + (f" peak {_gib(r.get('peak'))}" if r.get("peak") else ""))
            print("  ".join(msg), flush=True)
            write(out, rows + [model_row(model, runs, seq, batch, meta)], meta)  # so far: a timeout keeps it
        if any(runs.values()):
            rows.append(model_row(model, runs, seq, batch, meta))
            write(out, rows, meta)
        if stop:
            break
    meta["total_s"] = time.monotonic() - started
    text = write(out, rows, meta)
    print("\n" + text, flush=True)
    if any(r.get("errors") for r in rows) or not rows or any(not r.get(s) for r in rows for s in sides):
        sys.exit(1)


if __name__ == "__main__":
    main()
