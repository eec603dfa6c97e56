"""Which code maps and block sizes the "8bit" / "4bit" moment formats use: an accuracy study on
the CPU (docs/low-bit-states.md has the results and the choice).

    nice python benchmarks/quant_study.py [--steps 300] [--seeds 2] [--json out.json]

Three measurements, each over the candidate maps of ``optim/kernels/quant.py`` (signed maps for
``exp_avg``, unsigned for ``exp_avg_sq``) and block sizes, all blocks on the flat grid of the
params concatenated in order (as a bucket holds them; ``aligned`` rows pad each param to whole
blocks instead):

1. real moments: the examples' char GPT (a small config) trained ``--steps`` steps with fp32
   ``torch.optim.AdamW``; at a few steps its moments are quantized and dequantized, and we report
   the relative L2 error of each moment and of the Adam update ``m_hat / (sqrt(v_hat) + eps)``
   they give, and the largest update element over the exact one's largest (a second moment
   rounded toward 0 shows there: the update explodes);
2. training with quantized moments: the same runs with the moments stored through the format
   after every step (the step reads them dequantized, updates in fp32 and stores them quantized
   again, as the fused step will), final train and validation loss against fp32 and bf16
   moments, over ``--seeds`` seeds, and the drift: the relative L2 error of the update the
   stored moments give against the one of fp32 moments fed the same grads (what rounding
   compounds to over many steps; mean over the run's second half);
3. synthetic heavy-tailed moments: second moments log-uniform over 8 decades inside every block
   and first moments of Student-t(3) noise under them: the same errors as 1.

Accuracy decides, not speed: the reference math runs here, not a kernel.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))  # gpt.py, chardata.py

from chardata import CharData  # noqa: E402
from gpt import GPT, GPTConfig, loss_fn  # noqa: E402
from shardamp.optim import state_formats  # noqa: E402
from shardamp.optim.kernels import quant  # noqa: E402

EPS = 1e-8
BETAS = (0.9, 0.95)
LR = 3e-3
BATCH = 16
SNAPSHOTS = (25, 100, 200, 300)
# candidates per bit width: signed maps (exp_avg), unsigned maps (exp_avg_sq), block sizes
SIGNED = ("linear", "dynamic", "dynamic_sym", "square")
UNSIGNED = ("linear", "linear_nz", "dynamic", "dynamic_nz", "square", "square_nz")
BLOCKS = {8: (64, 256, 2048), 4: (32, 128, 512)}


# ---------------------------------------------------------------------------- quantization
def roundtrip(x: torch.Tensor, kind: str, bits: int, signed: bool, block: int,
              sizes: Optional[List[int]] = None) -> torch.Tensor:
    """``x`` (flat, params in order) through the format and back. ``sizes``: each param's
    element count, to pad every param to whole blocks (the ``aligned`` layout)."""
    qmap = quant.code_map(kind, bits, signed)
    if sizes is None:
        codes, scales = quant.quantize_packed(x, qmap, bits, block)
        return quant.dequantize_packed(codes, scales, qmap, bits, block, x.numel())
    out, start = [], 0
    for n in sizes:
        piece = x[start:start + n]
        codes, scales = quant.quantize_packed(piece, qmap, bits, block)
        out.append(quant.dequantize_packed(codes, scales, qmap, bits, block, n))
        start += n
    return torch.cat(out)


def update(m: torch.Tensor, v: torch.Tensor, step: int) -> torch.Tensor:
    """Adam's update direction from the stored moments, bias-corrected (lr 1)."""
    bc1, bc2 = 1 - BETAS[0] ** step, 1 - BETAS[1] ** step
    return (m / bc1) / ((v / bc2).sqrt() + EPS)


def errors(m: torch.Tensor, v: torch.Tensor, mq: torch.Tensor, vq: torch.Tensor, step: int) -> Dict[str, float]:
    u, uq = update(m, v, step), update(mq, vq, step)
    rel = lambda a, b: float((a - b).norm() / b.norm().clamp_min(1e-30))  # noqa: E731
    return {"m": rel(mq, m), "v": rel(vq, v), "update": rel(uq, u),
            "blowup": float(uq.abs().max() / u.abs().max().clamp_min(1e-30))}


# ---------------------------------------------------------------------------- training
def make_model(data: CharData, seed: int) -> GPT:
    torch.manual_seed(seed)
    return GPT(GPTConfig(vocab_size=data.vocab_size, seq_len=64, dim=64, layers=2, heads=4))


def flat_state(opt: torch.optim.Optimizer, params: List[torch.nn.Parameter], key: str) -> torch.Tensor:
    return torch.cat([opt.state[p][key].reshape(-1) for p in params])


def store(opt: torch.optim.Optimizer, params: List[torch.nn.Parameter], key: str, flat: torch.Tensor) -> None:
    start = 0
    for p in params:
        t = opt.state[p][key]
        t.copy_(flat[start:start + t.numel()].view_as(t))
        start += t.numel()


def train(data: CharData, seed: int, steps: int, fmt: Optional[Tuple] = None,
          snapshots: Tuple[int, ...] = ()) -> Dict[str, object]:
    """``steps`` AdamW steps; ``fmt``: None (fp32 moments), ("bf16",) or (bits, m_kind, v_kind,
    block): the moments stored through that format after every step."""
    model = make_model(data, seed)
    params = list(model.parameters())
    opt = torch.optim.AdamW(model.param_groups(0.1), lr=LR, betas=BETAS, eps=EPS, foreach=False)
    losses, snaps, drift = [], {}, []
    shadow = None  # fp32 moments fed the same grads: what the stored ones drift from, step after step
    for step in range(1, steps + 1):
        x, y = data.batch(step, 0, BATCH)
        loss = loss_fn(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
        if fmt is not None:
            with torch.no_grad():
                g = torch.cat([p.grad.reshape(-1) for p in params])
                if shadow is None:
                    shadow = [torch.zeros_like(g), torch.zeros_like(g)]
                shadow[0].mul_(BETAS[0]).add_(g, alpha=1 - BETAS[0])
                shadow[1].mul_(BETAS[1]).addcmul_(g, g, value=1 - BETAS[1])
            with torch.no_grad():
                for key, signed in (("exp_avg", True), ("exp_avg_sq", False)):
                    flat = flat_state(opt, params, key)
                    if fmt[0] == "bf16":
                        flat = flat.bfloat16().float()
                    else:
                        bits, m_kind, v_kind, block = fmt
                        flat = roundtrip(flat, m_kind if signed else v_kind, bits, signed, block)
                    store(opt, params, key, flat)
                if step > steps // 2:  # the stored moments' update against the shadow's, second half
                    u = update(shadow[0], shadow[1], step)
                    uq = update(flat_state(opt, params, "exp_avg"), flat_state(opt, params, "exp_avg_sq"), step)
                    drift.append(float((uq - u).norm() / u.norm()))
        if step in snapshots:
            snaps[step] = (flat_state(opt, params, "exp_avg").clone(), flat_state(opt, params, "exp_avg_sq").clone())
    with torch.no_grad():
        val = sum(float(loss_fn(model(x), y)) for x, y in data.val_batches(8, 32)) / 8
    return {"train": sum(losses[-20:]) / len(losses[-20:]), "val": val, "snaps": snaps, "sizes": [p.numel() for p in params],
            "drift": sum(drift) / len(drift) if drift else 0.0}


# ---------------------------------------------------------------------------- the study
def moment_table(snaps: Dict[int, Tuple[torch.Tensor, torch.Tensor]], sizes: List[int]) -> List[Dict[str, object]]:
    """Part 1 (and 3 with synthetic snapshots): each candidate on its own moment (the other exact),
    errors averaged over the snapshots."""
    rows = []

    def add(bits: int, moment: str, kind: str, block: int, aligned: bool = False) -> None:
        acc: Dict[str, float] = {}
        for step, (m, v) in snaps.items():
            signed = moment == "exp_avg"
            q = roundtrip(m if signed else v, kind, bits, signed, block, sizes if aligned else None)
            e = errors(m, v, q if signed else m, v if signed else q, step)
            for k, val in e.items():
                acc[k] = max(acc.get(k, 0.0), val) if k == "blowup" else acc.get(k, 0.0) + val / len(snaps)
        rows.append(dict(bits=bits, moment=moment, map=kind, block=block, aligned=aligned, **acc))

    for bits in (8, 4):
        for block in BLOCKS[bits]:
            for kind in SIGNED:
                add(bits, "exp_avg", kind, block)
            for kind in UNSIGNED:
                add(bits, "exp_avg_sq", kind, block)
    return rows


def synthetic(n: int = 1 << 16, seed: int = 0) -> Dict[int, Tuple[torch.Tensor, torch.Tensor]]:
    """Second moments log-uniform over 1e-12 .. 1e-4 elementwise (8 decades inside any block), first
    moments sqrt(v) times Student-t(3) noise over 3: heavy tails in both."""
    g = torch.Generator().manual_seed(seed)
    v = 10.0 ** (torch.rand(n, generator=g) * 8 - 12)
    t = torch.distributions.StudentT(3.0).sample((n,)) / 3
    return {1000: (v.sqrt() * t, v)}


def main(argv: Optional[List[str]] = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--seeds", type=int, default=2)
    ap.add_argument("--json", type=str, default=None, help="write every number here")
    ap.add_argument("--runs", type=str, default=None,
                    help="comma-separated training runs (their names as printed; default all)")
    ap.add_argument("--no-moments", action="store_true", help="skip parts 1 and 3 (the moments' errors)")
    ap.add_argument("--no-training", action="store_true", help="skip part 2 (the training runs)")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    t0 = time.time()
    data = CharData(seq_len=64, seed=0)
    out: Dict[str, object] = {"steps": args.steps, "seeds": args.seeds, "real_moments": [], "synthetic_moments": []}
    if not args.no_moments:
        moment_parts(data, args.steps, out)
        print(f"# part 1 and 3 done in {time.time() - t0:.0f} s", flush=True)
    out["training"] = {} if args.no_training else train_part(data, args)
    print(f"# done in {time.time() - t0:.0f} s", flush=True)
    report(out, args.json)


def moment_parts(data: CharData, steps: int, out: Dict[str, object]) -> None:
    """Parts 1 and 3 into ``out``."""
    ref = train(data, 0, steps, snapshots=tuple(s for s in SNAPSHOTS if s <= steps))

    real = moment_table(ref["snaps"], ref["sizes"])
    # the flat grid against blocks that start at each param, for the formats' own maps and blocks
    for fmt in (state_formats.Q8, state_formats.Q4):
        bits, block, (m_kind, v_kind) = fmt.bits, fmt.block_size, fmt.maps
        for moment, kind in (("exp_avg", m_kind), ("exp_avg_sq", v_kind)):
            acc: Dict[str, float] = {}
            for step, (m, v) in ref["snaps"].items():
                signed = moment == "exp_avg"
                q = roundtrip(m if signed else v, kind, bits, signed, block, ref["sizes"])
                e = errors(m, v, q if signed else m, v if signed else q, step)
                for k, val in e.items():
                    acc[k] = max(acc.get(k, 0.0), val) if k == "blowup" else acc.get(k, 0.0) + val / len(ref["snaps"])
            real.append(dict(bits=bits, moment=moment, map=kind, block=block, aligned=True, **acc))
    out["real_moments"] = real
    out["synthetic_moments"] = moment_table(synthetic(), [1 << 16])


def train_part(data: CharData, args: argparse.Namespace) -> Dict[str, Dict[str, List[float]]]:
    """Part 2: the training runs, per seed."""

    runs: Dict[str, Optional[Tuple]] = {"fp32": None, "bf16": ("bf16",)}
    for bits, block, pairs in (
            (8, 256, [("dynamic", "dynamic"), ("dynamic", "dynamic_nz"), ("dynamic_sym", "dynamic"),
                      ("dynamic_sym", "dynamic_nz"), ("dynamic_sym", "square_nz"), ("square", "dynamic_nz"),
                      ("linear", "linear_nz")]),
            (8, 2048, [("dynamic_sym", "dynamic")]),
            (4, 128, [("dynamic", "dynamic"), ("dynamic", "linear_nz"), ("dynamic_sym", "linear_nz"),
                      ("dynamic_sym", "dynamic_nz"), ("dynamic_sym", "square_nz"), ("dynamic", "square_nz"),
                      ("square", "square_nz"), ("square", "dynamic_nz"), ("linear", "square_nz"),
                      ("linear", "linear_nz")]),
            (4, 32, [("dynamic_sym", "square_nz")]),
            (4, 512, [("dynamic_sym", "square_nz")])):
        for m_kind, v_kind in pairs:
            runs[f"{bits}bit {m_kind}/{v_kind} b{block}"] = (bits, m_kind, v_kind, block)
    if args.runs:
        wanted = args.runs.split(",")
        unknown = [w for w in wanted if w not in runs]
        if unknown:
            raise SystemExit(f"--runs: unknown {unknown}; the runs are {list(runs)}")
        runs = {k: runs[k] for k in wanted}
    training = {}
    for name, fmt in runs.items():
        res = [train(data, seed, args.steps, fmt) for seed in range(args.seeds)]
        training[name] = {k: [r[k] for r in res] for k in ("train", "val", "drift")}
        print(f"{name:36s} train {' '.join(f'{r:.4f}' for r in training[name]['train'])}  "
              f"val {' '.join(f'{r:.4f}' for r in training[name]['val'])}  "
              f"drift {' '.join(f'{r:.4f}' for r in training[name]['drift'])}", flush=True)
    return training


def report(out: Dict[str, object], path: Optional[str]) -> None:
    """The tables, in Markdown; every number as JSON to ``path``."""
    for part in ("real_moments", "synthetic_moments"):
        print(f"\n## {part}: relative L2 error of the moment and of the update, largest update / exact largest")
        print("| bits | moment | map | block | aligned | moment err | update err | blowup |")
        print("|---|---|---|---|---|---|---|---|")
        for r in out[part]:
            print(f"| {r['bits']} | {r['moment']} | {r['map']} | {r['block']} | {'yes' if r['aligned'] else ''} | "
                  f"{r['m'] if r['moment'] == 'exp_avg' else r['v']:.4f} | {r['update']:.4f} | {r['blowup']:.2f} |")
    print("\n## training: final train loss (mean of the last 20 steps), validation loss and the update's drift "
          "from fp32 moments fed the same grads (relative L2, mean over the second half), per seed")
    print("| moments | train | val | drift |")
    print("|---|---|---|---|")
    for name, r in out["training"].items():
        print(f"| {name} | " + " | ".join(" / ".join(f"{x:.4f}" for x in r[k]) for k in ("train", "val", "drift")) + " |")
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(out, indent=1, default=lambda o: None))


if __name__ == "__main__":
    main()
