"""The low-bit moment formats on the main job: final train / validation loss and bytes per owned
param against fp32 and bf16 moments and against torchao's and bitsandbytes' low-bit AdamW, on the
CPU (docs/low-bit-states.md has the tables and what they decide).

    nice python benchmarks/low_bit_accuracy.py [--steps 200] [--seeds 0 1 2] [--json out.json]
    python benchmarks/low_bit_accuracy.py --tables a.json b.json   # the tables of earlier runs, merged

The main job is examples/train.py's char GPT with its recipe (examples/recipe.py: lr 3e-3 with
warmup and cosine decay, betas (0.9, 0.95), weight decay 0.1 on matrices and embeddings, global
clip at 1.0, fp32 with a loss scaler, batch 16 per rank at world 2). Here one process feeds every
step both ranks' batches as one batch of 32 (the mean over 32 is the average of the two ranks'
means, the grads the sharded run averages), so every optimizer sees the same data: shardamp's
``DistributedFusedAdam`` at world 1 (its states are bitwise the same at any world size for the
same grads: tests/test_low_bit.py) with ``ShardedGradScaler``, the peers with
``torch.amp.GradScaler``; the clip is ``torch.nn.utils.clip_grad_norm_`` over the model for all.

Runs (``--runs`` picks some):

- ``fp32``, ``bf16``, ``8bit``, ``4bit``: both moments in that format (shardamp, every param);
- ``8bit_small_fp32``, ``4bit_small_fp32``: the same with params under 4096 elements in a second
  ``DistributedFusedAdam`` with fp32 moments (what torchao and bitsandbytes do with small tensors);
- ``4bit_b32``, ``4bit_b64``, ``4bit_b128``: 4-bit moments with that ``quant_block_size``;
- ``torchao_8bit``, ``torchao_4bit``: ``torchao.optim.AdamW8bit`` / ``AdamW4bit`` (their defaults:
  blocks 256 / 128, tensors under 4096 elements or not a multiple of the block kept fp32);
- ``bnb_8bit``: ``bitsandbytes.optim.AdamW8bit`` (blockwise, ``min_8bit_size=4096``).

A peer that does not import or fails to step is recorded with its error, not run. The memory
table is ``memory_stats()`` per owned param (world 1: every param) for each format over the same
model in two settings: fp32 params, fp32 grads; bf16 params with ``store_param_remainders`` and
bf16 grads (the lightest). The peers' state bytes are their state tensors' storage.
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))  # gpt.py, chardata.py, recipe.py

from chardata import CharData  # noqa: E402
from gpt import GPT, GPTConfig, loss_fn  # noqa: E402
from recipe import Recipe  # noqa: E402
from shardamp.optim import DistributedFusedAdam  # noqa: E402
from shardamp.scaler import ShardedGradScaler  # noqa: E402

WORLD, PER_RANK = 2, 16  # the main job's ranks and per-rank batch
SMALL = 4096  # torchao's and bitsandbytes' threshold (bitsandbytes' min_8bit_size)
FORMATS = {"fp32": torch.float32, "bf16": torch.bfloat16, "8bit": "8bit", "4bit": "4bit"}
RUNS = ("fp32", "bf16", "8bit", "4bit", "8bit_small_fp32", "4bit_small_fp32", "4bit_b32", "4bit_b64",
        "4bit_b128", "torchao_8bit", "torchao_4bit", "bnb_8bit")
# two-sided 95% Student t quantiles by degrees of freedom (the paired intervals over seeds)
T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145,
        2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048,
        2.045, 2.042)


def recipe(steps: int) -> Recipe:
    """examples/train.py's defaults (fp32 on the CPU: no autocast, the scaler on)."""
    return Recipe(steps=steps, batch_size=PER_RANK, lr=3e-3, min_lr_ratio=0.1, warmup_steps=20,
                  weight_decay=0.1, max_grad_norm=1.0, precision="fp32", init_scale=2.0 ** 16,
                  growth_interval=100)


def make_model(data: CharData, seed: int, dtype: torch.dtype = torch.float32) -> GPT:
    torch.manual_seed(seed)
    return GPT(GPTConfig(data.vocab_size, 64, 128, 4, 4)).to(dtype)  # the main job's defaults


def shardamp_opts(model: GPT, rec: Recipe, fmt: Any, small_fp32: bool = False,
                  **kw: Any) -> List[torch.optim.Optimizer]:
    """One DistributedFusedAdam with both moments in ``fmt``; with ``small_fp32`` the params under
    SMALL elements go to a second one with fp32 moments."""
    common = dict(lr=rec.lr, betas=rec.betas, eps=rec.eps, **kw)
    groups = model.param_groups(rec.weight_decay)
    if not small_fp32:
        return [DistributedFusedAdam(groups, exp_avg_dtype=fmt, exp_avg_sq_dtype=fmt, **common)]
    big = [dict(g, params=[p for p in g["params"] if p.numel() >= SMALL]) for g in groups]
    small = [dict(g, params=[p for p in g["params"] if p.numel() < SMALL]) for g in groups]
    return [DistributedFusedAdam([g for g in big if g["params"]], exp_avg_dtype=fmt, exp_avg_sq_dtype=fmt, **common),
            DistributedFusedAdam([g for g in small if g["params"]],
                                 **{k: v for k, v in common.items() if k != "quant_block_size"})]


def peer_opt(name: str, model: GPT, rec: Recipe) -> torch.optim.Optimizer:
    groups = model.param_groups(rec.weight_decay)
    if name.startswith("torchao"):
        from torchao.optim import AdamW4bit, AdamW8bit
        cls = AdamW8bit if name.endswith("8bit") else AdamW4bit
        return cls(groups, lr=rec.lr, betas=rec.betas, eps=rec.eps)
    import bitsandbytes as bnb
    return bnb.optim.AdamW8bit(groups, lr=rec.lr, betas=rec.betas, eps=rec.eps)


@torch.no_grad()
def evaluate(model: GPT, data: CharData) -> float:
    batches = data.val_batches(8, PER_RANK)  # examples/train.py's validation
    return sum(loss_fn(model(x), y).item() for x, y in batches) / len(batches)


def train(name: str, seed: int, steps: int) -> Dict[str, Any]:
    rec = recipe(steps)
    data = CharData(64, seed)
    model = make_model(data, seed)
    ours = not name.startswith(("torchao", "bnb"))
    if ours:
        fmt, _, variant = name.partition("_")
        block = dict(quant_block_size=int(variant[1:])) if variant.startswith("b") else {}
        opts = shardamp_opts(model, rec, FORMATS[fmt], variant == "small_fp32", **block)
        scaler: Any = ShardedGradScaler("cpu", **rec.scaler_kwargs())
    else:
        opts = [peer_opt(name, model, rec)]
        scaler = torch.amp.GradScaler("cpu", **rec.scaler_kwargs())
    losses: List[float] = []
    t0 = time.perf_counter()
    for step in range(steps):
        for opt in opts:
            for group in opt.param_groups:
                if isinstance(group["lr"], torch.Tensor):  # torchao holds lr as a tensor
                    group["lr"].fill_(rec.lr_at(step))
                else:
                    group["lr"] = rec.lr_at(step)
        xs, ys = zip(*(data.batch(step, rank, PER_RANK) for rank in range(WORLD)))
        loss = loss_fn(model(torch.cat(xs)), torch.cat(ys))
        scaler.scale(loss).backward()
        for opt in opts:
            scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), rec.max_grad_norm)
        for opt in opts:
            scaler.step(opt)
        scaler.update()
        for opt in opts:
            opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    seconds = time.perf_counter() - t0
    for opt in opts:
        if hasattr(opt, "param_sync"):
            opt.param_sync()
    tail = losses[-20:]
    out = {"train": sum(tail) / len(tail), "val": evaluate(model, data), "s_per_step": seconds / steps,
           "finite": all(math.isfinite(v) for v in losses), "losses": losses}
    if not ours:
        out["state_bytes"] = peer_state_bytes(opts[0])
        out["n_params"] = sum(p.numel() for p in model.parameters())
    del opts
    return out


def peer_state_bytes(opt: torch.optim.Optimizer) -> int:
    """The bytes of every tensor in the optimizer's state (a tensor subclass's inner tensors),
    each storage once (shared code maps counted once)."""
    seen: Dict[int, int] = {}

    def visit(t: torch.Tensor) -> None:
        names = getattr(t, "__tensor_flatten__", None)
        if names is not None and type(t) is not torch.Tensor:
            for inner in t.__tensor_flatten__()[0]:
                visit(getattr(t, inner))
            return
        if t.dim() == 0 and t.numel() == 1 and t.dtype in (torch.float32, torch.int64):
            return  # the step count
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()

    for state in opt.state.values():
        for v in state.values():
            if isinstance(v, torch.Tensor):
                visit(v)
    return sum(seen.values())


def memory_table() -> List[Dict[str, Any]]:
    """memory_stats() per owned param after one step, per format and setting."""
    data = CharData(64, 0)
    rows = []
    for setting, dtype, kw in (("fp32 params, fp32 grads", torch.float32, {}),
                               ("bf16 params + remainders, bf16 grads", torch.bfloat16,
                                dict(store_param_remainders=True))):
        for fmt_name, fmt in FORMATS.items():
            model = make_model(data, 0, dtype)
            n = sum(p.numel() for p in model.parameters())
            opt, = shardamp_opts(model, recipe(1), fmt, False, **kw)
            x, y = data.batch(0, 0, 2)
            loss_fn(model(x), y).float().backward()
            opt.step()
            st = opt.memory_stats()
            owned = sum(b.shard_numel for b in opt._buckets)
            rows.append({"setting": setting, "format": fmt_name, "n_params": n, "owned": owned,
                         **{k: v / owned for k, v in st.items()}})
            del opt
    return rows


def paired(results: Dict[str, Dict[int, Dict[str, Any]]], name: str, base: str,
           key: str = "val") -> Optional[Tuple[List[float], float, float, float]]:
    """The per-seed relative differences of run ``name`` from run ``base`` on the seeds both ran
    (``key``: "val" or "train"), their mean and its two-sided 95% Student t interval."""
    seeds = sorted(set(results.get(name, {})) & set(results.get(base, {})))
    if not seeds:
        return None
    diffs = [(results[name][s][key] - results[base][s][key]) / results[base][s][key] for s in seeds]
    m = statistics.mean(diffs)
    if len(diffs) < 2:
        return diffs, m, float("nan"), float("nan")
    half = T975[min(len(diffs) - 2, len(T975) - 1)] * statistics.stdev(diffs) / math.sqrt(len(diffs))
    return diffs, m, m - half, m + half


def merge(paths: List[str]) -> Tuple[Dict[str, Dict[int, Dict[str, Any]]], Dict[str, str], List[Dict[str, Any]], int]:
    """The results of several ``--json`` files as one (a run and seed found twice must agree)."""
    results: Dict[str, Dict[int, Dict[str, Any]]] = {}
    errors: Dict[str, str] = {}
    memory: List[Dict[str, Any]] = []
    steps = set()
    for path in paths:
        doc = json.loads(Path(path).read_text())
        steps.add(doc["args"]["steps"])
        errors.update(doc["errors"])
        memory = memory or doc.get("memory") or []
        for name, per_seed in doc["results"].items():
            for seed, r in per_seed.items():
                old = results.setdefault(name, {}).get(int(seed))
                if old is not None and (old["train"], old["val"]) != (r["train"], r["val"]):
                    raise ValueError(f"{path}: {name} seed {seed} differs from an earlier file's")
                results[name][int(seed)] = r
    if len(steps) != 1:
        raise ValueError(f"--tables: the files ran different --steps: {sorted(steps)}")
    return results, errors, memory, steps.pop()


def main(argv: Optional[List[str]] = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--runs", nargs="+", default=list(RUNS), choices=RUNS)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", default=None)
    ap.add_argument("--no-memory", action="store_true", help="skip the memory table")
    ap.add_argument("--tables", nargs="+", default=None, metavar="JSON",
                    help="run nothing: print the tables of these --json files, merged")
    args = ap.parse_args(argv)
    if args.tables:
        results, errors, memory, steps = merge(args.tables)
        print_tables(results, errors, memory, steps)
        return
    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    results: Dict[str, Dict[int, Dict[str, Any]]] = {}
    errors: Dict[str, str] = {}
    for name in args.runs:
        for seed in args.seeds:
            try:
                r = train(name, seed, args.steps)
            except Exception as exc:  # a peer that cannot run here: recorded, not fatal
                if name.startswith(("torchao", "bnb")):
                    errors[name] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"
                    print(f"{name}: {errors[name]}", flush=True)
                    break
                raise
            results.setdefault(name, {})[seed] = r
            print(f"{name} seed {seed}: train {r['train']:.4f} val {r['val']:.4f} "
                  f"({r['s_per_step'] * 1e3:.0f} ms/step)", flush=True)
    memory = [] if args.no_memory else memory_table()
    print_tables(results, errors, memory, args.steps)
    print(f"total {time.perf_counter() - t0:.0f} s")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"args": vars(args), "results": results, "errors": errors,
                                               "memory": memory}, indent=1))


def _interval(p: Optional[Tuple[List[float], float, float, float]]) -> str:
    if p is None:
        return "- | -"
    return f"{100 * p[1]:+.2f}% | [{100 * p[2]:+.2f}%, {100 * p[3]:+.2f}%]"


def print_tables(results: Dict[str, Dict[int, Dict[str, Any]]], errors: Dict[str, str],
                 memory: List[Dict[str, Any]], steps: int) -> None:
    seeds = sorted({s for per_seed in results.values() for s in per_seed})
    print(f"\n{steps} steps, seeds {seeds}; train: mean of the last 20 steps' loss; val: 8 batches; "
          "vs a run: the mean over the seeds both ran of the per-seed relative difference, and its 95% t interval")
    print("| moments | seeds | train, mean | val, mean | val vs fp32, per seed | val vs fp32, mean | 95% interval "
          "| train vs fp32, mean | 95% interval |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, per_seed in results.items():
        ran = sorted(per_seed)
        tr = statistics.mean(per_seed[s]["train"] for s in ran)
        va = statistics.mean(per_seed[s]["val"] for s in ran)
        pv = paired(results, name, "fp32") if name != "fp32" else None
        each = " / ".join(f"{100 * d:+.2f}" for d in pv[0]) if pv else "-"
        print(f"| {name} | {len(ran)} | {tr:.4f} | {va:.4f} | {each} | {_interval(pv)} | "
              f"{_interval(paired(results, name, 'fp32', 'train') if name != 'fp32' else None)} |")
    # the variants against the default block, and ours against the peers of the same width
    for base, prefix in (("4bit", "4bit_"), ("8bit", "8bit_"), ("torchao_4bit", "4bit"), ("torchao_8bit", "8bit"),
                         ("bnb_8bit", "8bit")):
        if base not in results:
            continue
        rows = [n for n in results if n.startswith(prefix) and n != base]
        if rows:
            print(f"\n| moments | val vs {base}, mean | 95% interval | train vs {base}, mean | 95% interval |")
            print("|---|---|---|---|---|")
            for name in rows:
                print(f"| {name} | {_interval(paired(results, name, base))} | "
                      f"{_interval(paired(results, name, base, 'train'))} |")
    for name, err in errors.items():
        print(f"| {name} | did not run: {err} |")
    labels = ("setting", "format", "n_params", "owned")
    if memory:
        print("\n| setting | format | " + " | ".join(k for k in memory[0] if k not in labels) + " |")
        for row in memory:
            print(f"| {row['setting']} | {row['format']} | "
                  + " | ".join(f"{v:.3f}" for k, v in row.items() if k not in labels) + " |")
    for name, per_seed in results.items():
        r = next(iter(per_seed.values()))
        if "state_bytes" in r:
            print(f"{name}: optimizer state {r['state_bytes'] / r['n_params']:.3f} B per param")


if __name__ == "__main__":
    main()
