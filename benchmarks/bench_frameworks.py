"""Each framework's default route against its shardamp route, at world 1 or on ``--nproc`` GPUs
of one host, in the framework's own loop: iteration time with a paired ratio and its 95%
interval, and peak memory.

    python benchmarks/bench_frameworks.py --device cuda --out out/frameworks_bench      # under 6 min (--budget)
    python benchmarks/bench_frameworks.py --device cpu --small --repeats 2 --iters 3 --out out/fw_cpu
    python benchmarks/bench_frameworks.py --device cuda --frameworks lightning --models gpt2 --precisions fp16
    python benchmarks/bench_frameworks.py --device cuda --nproc 8 --models gpt2-large   # 8 GPUs: DDP against ZeRO-2
    python benchmarks/bench_frameworks.py --device cuda --frameworks lightning --models mlp --precisions bf16 --profile

Frameworks (benchmarks/framework_routes.py has the details of each route):

* lightning: ``Trainer(strategy="auto")`` + ``AdamW(fused=True)`` vs ``Trainer(strategy="shardamp")``;
* accelerate: ``Accelerator`` + ``AdamW(fused=True)`` vs ``ShardampAccelerator``, in its documented
  loop (backward, clip_grad_norm_, step, zero_grad);
* transformers: ``Trainer(optim="adamw_torch_fused")`` vs ``ShardampTrainer`` (the mixin route),
  each ``Trainer.train()``;

in each precision as the framework does mixed precision (Lightning ``"bf16-mixed"`` /
``"16-mixed"``, accelerate ``mixed_precision``, Trainer ``bf16`` / ``fp16``), on two models: the
MLP of the framework examples (33.6M params, batch 64) and GPT-2 124M (transformers'
``GPT2LMHeadModel`` from ``GPT2Config()``, random init, batch 8 x 512 tokens); ``--models gpt2-b2``
adds GPT-2 124M at batch 2 x 512 (a fine-tuning micro-batch: the same optimizer step over a
quarter of the tokens, so the step is a larger share of the iteration); ``--models gpt2-large``
GPT-2 large (774M params: 36 layers of width 1280) at batch 8 x 512, whose iteration is bound by
the GPU rather than by the host's launches, with an optimizer step over six times the bytes;
``--models gpt2-large-b2`` the same at batch 2 x 512; ``--models mlp-wide`` the MLP at width
8192 (537M params, batch 64), an iteration that is mostly its optimizer step. ``--small``: tiny
versions of them for a CPU smoke run (benchmarks/framework_models.py).

How: one process per framework (Lightning's launcher exports LOCAL_RANK / WORLD_SIZE even at one
device, which would turn accelerate's and the Trainer's default route into DDP in the same
process), one GPU (``CUDA_VISIBLE_DEVICES=0`` unless set: the Trainer would take every visible
GPU with DataParallel). ``--nproc N``: the worker is started with ``torch.distributed.run
--standalone --nproc_per_node N`` (the first N GPUs, or N gloo ranks on the CPU), each rank
trains its own micro-batch of the model's batch size, so the default routes are each framework's
DDP (Lightning's ``"ddp"``, accelerate's and the Trainer's MULTI_GPU) and the shardamp routes
shard the step ZeRO-2 style; rank 0 times and reports, and what a rank decides from its own clock
(``--budget``) is rank 0's decision on every rank. Per (framework, model, precision):
``--repeats`` pairs, default and shardamp alternating with the order flipped every repeat (AB
BA AB ...), each run a fresh model, optimizer and trainer / accelerator; ``--warmup`` iterations, then ``--iters`` timed
between two device synchronizations. Reported: the median ms per iteration of each route, the
ratio default / shardamp (> 1: shardamp is faster) as the geometric mean of the pairs' ratios
with its 95% t-interval (``host_iteration.paired_ratio``, as bench_host.py), the same ratio of
each run's median iteration (CUDA events at each step's end, no sync inside the block: a run's
few iterations lost to something else on the machine do not move it), and the median peak
``torch.cuda.max_memory_allocated`` of a run above what was allocated before it.

``--budget SECONDS`` (default 330): no new (framework, model, precision) starts once it is spent
or when the previous one of the same model would not fit in what is left; the table says what was
left out. A SIGTERM (``timeout``) stops the running worker and still writes what was measured.
Writes ``<out>/bench_frameworks.json`` (every run) and ``<out>/bench_frameworks.md`` (the table,
also printed last).
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from framework_models import DEFAULT_MODELS, MODELS  # noqa: E402
from framework_routes import FRAMEWORKS, PRECISIONS, Setting, worker  # noqa: E402
from host_iteration import paired_ratio  # noqa: E402

WORKER_GRACE_S = 150  # past the budget, a worker may finish the config it started; beyond that it hangs


def _names(text: str, allowed: tuple, flag: str, parser: argparse.ArgumentParser) -> List[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    bad = [n for n in names if n not in allowed]
    if bad or not names:
        parser.error(f"{flag}: {', '.join(bad) or 'nothing given'}; choose from {', '.join(allowed)}")
    return names


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--frameworks", default=",".join(FRAMEWORKS))
    p.add_argument("--models", default=",".join(DEFAULT_MODELS),
                   help=f"comma-separated, from {', '.join(MODELS)} (default: %(default)s)")
    p.add_argument("--precisions", default=",".join(PRECISIONS))
    p.add_argument("--repeats", type=int, default=None, help="pairs per configuration (default: 5 cuda, 2 cpu)")
    p.add_argument("--iters", type=int, default=None, help="timed iterations per run (default: 25 cuda, 3 cpu)")
    p.add_argument("--warmup", type=int, default=None, help="iterations before the timed ones (default: 5 cuda, 2 cpu)")
    p.add_argument("--small", action="store_true", help="tiny MLP and GPT-2 (a CPU smoke run)")
    p.add_argument("--nproc", type=int, default=1,
                   help="processes (GPUs, or gloo CPU ranks) per run, started with torch.distributed.run; "
                        "each trains its own micro-batch, so the default routes wrap the model in DDP")
    p.add_argument("--budget", type=float, default=330.0, help="seconds; no new configuration starts past it (0: none)")
    p.add_argument("--out", default="out/frameworks_bench")
    p.add_argument("--profile", action="store_true",
                   help="after each config's pairs, record where each route's host time goes "
                        "(framework_profile.py) into <out>/profile/")
    # the worker's own flags (bench_frameworks.py starts itself once per framework)
    p.add_argument("--worker", choices=FRAMEWORKS, default=None, help=argparse.SUPPRESS)
    p.add_argument("--result", default=None, help=argparse.SUPPRESS)
    p.add_argument("--deadline", type=float, default=0.0, help=argparse.SUPPRESS)
    # the worker's --nproc (torch.distributed.run would take "--nproc" for its own --nproc-per-node)
    p.add_argument("--ranks", type=int, default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.ranks is not None:
        args.nproc = args.ranks
    cuda = args.device == "cuda"
    if cuda and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device is visible")
    for key, gpu, cpu in (("repeats", 5, 2), ("iters", 25, 3), ("warmup", 5, 2)):
        if getattr(args, key) is None:
            setattr(args, key, gpu if cuda else cpu)
    if args.nproc < 1:
        p.error("--nproc must be at least 1")
    if cuda and args.nproc > torch.cuda.device_count():
        p.error(f"--nproc {args.nproc}: only {torch.cuda.device_count()} CUDA device(s) are visible")
    if args.repeats < 1 or args.iters < 1 or args.warmup < 1:
        p.error("--repeats, --iters and --warmup must be at least 1 (the timer starts at the end of the warm-up)")
    args.framework_list = _names(args.frameworks, FRAMEWORKS, "--frameworks", p)
    args.model_list = _names(args.models, MODELS, "--models", p)
    args.precision_list = _names(args.precisions, PRECISIONS, "--precisions", p)
    return args


# ------------------------------------------------------------------------------ running the workers
class Stopped(Exception):
    """SIGTERM (e.g. from ``timeout``): stop the worker, report what was measured."""


def _on_sigterm(signum: int, frame: Any) -> None:
    raise Stopped()


def run_worker(framework: str, args: argparse.Namespace, deadline: Optional[float], out: Path) -> Dict[str, Any]:
    """Start this script as ``--worker framework`` and wait for it; its result (maybe partial)."""
    path = out / f"worker_{framework}.json"
    path.unlink(missing_ok=True)
    launch = [sys.executable] if args.nproc == 1 else [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.nproc}"]
    cmd = launch + [str(Path(__file__).resolve()), "--worker", framework, "--result", str(path), "--ranks", str(args.nproc),
           "--deadline", str(deadline or 0.0), "--device", args.device, "--models", args.models,
           "--precisions", args.precisions, "--repeats", str(args.repeats), "--iters", str(args.iters),
           "--warmup", str(args.warmup)] + (["--small"] if args.small else []) + (["--profile"] if args.profile else [])
    env = dict(os.environ)
    if args.device == "cuda":  # the Trainer takes every visible GPU (DataParallel) unless launched per rank
        env.setdefault("CUDA_VISIBLE_DEVICES", ",".join(str(i) for i in range(args.nproc)))
    # its own process group, so that stopping it stops anything it started too
    proc = subprocess.Popen(cmd, env=env, start_new_session=True)
    note = None
    try:
        proc.wait(timeout=None if deadline is None else max(deadline - time.time(), 0) + WORKER_GRACE_S)
    except subprocess.TimeoutExpired:
        note = f"stopped {WORKER_GRACE_S} s past the budget"
    finally:
        if proc.poll() is None:
            _stop(proc)
    result = json.loads(path.read_text()) if path.exists() else dict(framework=framework, configs=[])
    if note or proc.returncode:
        result["stopped"] = note or f"worker exited with {proc.returncode}"
        print(f"{framework}: {result['stopped']}", flush=True)
    return result


def _stop(proc: subprocess.Popen) -> None:
    for sig, wait in ((signal.SIGTERM, 15), (signal.SIGKILL, 15)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


# ------------------------------------------------------------------------------ summary
def summarise(result: Dict[str, Any], config: Dict[str, Any]) -> Dict[str, Any]:
    """A config's row: medians, the paired ratio default / shardamp with its 95% t-interval."""
    row = dict(framework=result["framework"], model=config["model"], precision=config["precision"],
               params=config.get("params"), status=config.get("status", "incomplete"), reason=config.get("reason"))
    by = {route: {r["repeat"]: r for r in config.get("runs", []) if r["route"] == route} for route in ("default", "shardamp")}
    pairs = sorted(set(by["default"]) & set(by["shardamp"]))
    if not pairs:
        return row
    d = [by["default"][i]["ms"] for i in pairs]
    s = [by["shardamp"][i]["ms"] for i in pairs]
    mean, lo, hi = paired_ratio(d, s)
    peaks = {route: [by[route][i]["peak_bytes"] for i in pairs if by[route][i]["peak_bytes"] is not None]
             for route in by}
    row.update(pairs=len(pairs), default_ms=statistics.median(d), shardamp_ms=statistics.median(s),
               ratio=mean, ratio_lo=lo, ratio_hi=hi, pair_ratios=[a / b for a, b in zip(d, s)],
               default_peak=statistics.median(peaks["default"]) if peaks["default"] else None,
               shardamp_peak=statistics.median(peaks["shardamp"]) if peaks["shardamp"] else None,
               routes={route: by[route][pairs[0]]["resolved"] for route in by})
    md = [by["default"][i].get("median_ms", float("nan")) for i in pairs]
    ms = [by["shardamp"][i].get("median_ms", float("nan")) for i in pairs]
    if all(v > 0 for v in md + ms):  # NaN (runs of an older worker: no per-iteration times) fails too
        row["median_ratio"], row["median_lo"], row["median_hi"] = paired_ratio(md, ms)
    return row


def _gib(b: Optional[float]) -> str:
    return "-" if b is None else f"{b / 2**30:.2f}"


def _count(n: int) -> str:
    return f"{n / 1e6:.1f}M" if n >= 1e6 else f"{n / 1e3:.1f}K"


def _x(v: float) -> str:
    return f"{v:.2f}" if 0.01 <= v < 100 else f"{v:.1g}"  # a 2-pair interval can span decades


def _ratio(row: Dict[str, Any]) -> str:
    return _interval(row["ratio"], row["ratio_lo"], row["ratio_hi"], row["pairs"])


def _median_ratio(row: Dict[str, Any]) -> str:
    if "median_ratio" not in row:
        return "-"
    return _interval(row["median_ratio"], row["median_lo"], row["median_hi"], row["pairs"])


def _interval(mean: float, lo: float, hi: float, pairs: int) -> str:
    if pairs < 2:
        return f"{_x(mean)}x (one pair: no interval)"
    return f"{_x(mean)}x [{_x(lo)}-{_x(hi)}]"


def table(rows: List[Dict[str, Any]], head: str, notes: Dict[str, List[str]]) -> str:
    """The markdown table, the routes each framework resolved to, and ``notes`` (reason -> what
    it concerns: one line per reason)."""
    lines = [head, "",
             "| framework | model | precision | default ms | shardamp ms | default / shardamp [95% t] "
             "| median iterations: default / shardamp [95% t] | pairs | peak GiB default | peak GiB shardamp |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    routes: Dict[str, Dict[str, str]] = {}
    for row in rows:
        model = row["model"] + (f" ({_count(row['params'])})" if row.get("params") else "")
        if "pairs" in row:
            lines.append(f"| {row['framework']} | {model} | {row['precision']} | {row['default_ms']:.2f} | "
                         f"{row['shardamp_ms']:.2f} | {_ratio(row)} | {_median_ratio(row)} | {row['pairs']} | "
                         f"{_gib(row['default_peak'])} | "
                         f"{_gib(row['shardamp_peak'])} |")
            routes.setdefault(row["framework"], row["routes"])
        if row["status"] != "ok":
            reason = row["status"] + (f", {row['reason']}" if row.get("reason") else "")
            notes.setdefault(reason, []).append(f"{row['framework']} {row['model']} {row['precision']}")
    lines.append("")
    for framework, r in routes.items():
        lines.append(f"- {framework}: default = {r['default']}; shardamp = {r['shardamp']}")
    lines += [f"- {reason}: {', '.join(where)}" if where else f"- {reason}" for reason, where in notes.items()]
    return "\n".join(lines) + "\n"


def main() -> None:
    args = parse_args()
    if args.worker:
        local = int(os.environ.get("LOCAL_RANK", 0)) if args.nproc > 1 else 0
        s = Setting(torch.device(args.device, local) if args.device == "cuda" else torch.device("cpu"), args.small,
                    args.warmup, args.iters, world=args.nproc,
                    rank=int(os.environ.get("RANK", 0)) if args.nproc > 1 else 0)
        if args.device == "cpu":
            torch.set_num_threads(min(2, os.cpu_count() or 1))
        worker(args.worker, args.result, args.deadline or None, args.model_list, args.precision_list, args.repeats, s,
               profile=args.profile)
        return
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    started = time.time()
    deadline = started + args.budget if args.budget > 0 else None
    signal.signal(signal.SIGTERM, _on_sigterm)
    results: List[Dict[str, Any]] = []
    notes: Dict[str, List[str]] = {}  # reason -> the frameworks / configs it concerns
    current = None
    try:
        for current in args.framework_list:
            if deadline is not None and time.time() >= deadline:
                notes.setdefault(f"not started, left out by --budget {args.budget:g} s", []).append(current)
                print(f"{current}: not started, left out by --budget {args.budget:g} s", flush=True)
                continue
            print(f"== {current}", flush=True)
            results.append(run_worker(current, args, deadline, out))
    except (Stopped, KeyboardInterrupt):
        notes[f"stopped by a signal during {current}: the frameworks after it were not run"] = []
        path = out / f"worker_{current}.json"  # what the stopped worker wrote before it stopped
        if path.exists():
            results.append(json.loads(path.read_text()))
    rows, info = [], {}
    for result in results:
        name = result["framework"]
        if result.get("status") == "skipped":
            notes.setdefault(f"skipped, {result['reason']}", []).append(name)
        if result.get("stopped"):
            notes.setdefault(result["stopped"], []).append(name)
        info = info or {k: result[k] for k in ("versions", "device_name", "kernels") if k in result}
        if result.get("kernels", "native") != "native":
            notes.setdefault(f"shardamp ran its {result['kernels']} kernels", []).append(name)
        rows += [summarise(result, c) for c in result.get("configs", [])]
    versions = ", ".join(f"{k} {v}" for k, v in info.get("versions", {"torch": torch.__version__}).items())
    head = (f"bench_frameworks on {info.get('device_name', args.device)}, {versions}, {time.strftime('%Y-%m-%d')}: "
            f"world {args.nproc}, ms per iteration (median of the repeats; {args.warmup} warm-up + {args.iters} timed iterations "
            f"per run), ratio = geometric mean of the paired runs' default / shardamp (> 1: shardamp faster), "
            f"{time.time() - started:.0f} s")
    text = table(rows, head, notes)
    summary = dict(command=" ".join(sys.argv), date=time.strftime("%Y-%m-%d"), seconds=time.time() - started,
                   settings={k: getattr(args, k) for k in ("device", "repeats", "iters", "warmup", "small", "budget", "nproc")},
                   **info, rows=rows, workers=results, notes=notes)
    (out / "bench_frameworks.json").write_text(json.dumps(summary, indent=1))
    (out / "bench_frameworks.md").write_text(text)
    print("\n" + text, flush=True)
    if any(r["status"] == "error" for r in rows) or any(r.get("stopped") for r in results):
        sys.exit(1)


if __name__ == "__main__":
    main()
