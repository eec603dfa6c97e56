"""bench_step.py's low-bit rows: moments in a blockwise format for the kernels' rows (``moment``),
and the peers' 8-bit optimizers on the same tensors (``peer_variants``): torchao's
``AdamW8bit`` and bitsandbytes' 8-bit ``AdamW``, each over unsharded bf16 params with bf16 grads
(the grads restored before each timing, as torch's row does), clipped by torch's
``clip_grad_norm_`` as shardamp's row clips. Where a package is not importable its row is left
out with a printed reason (the machine has no network: carry the wheels as bench_deepspeed.py's
are, benchmarks/README.md)."""
from __future__ import annotations

from typing import Callable, Dict, List, Optional, Tuple

import torch

# row name -> (the import, the optimizer class path): the first importable one is used
PEERS: Dict[str, List[Tuple[str, str]]] = {
    "torchao AdamW8bit": [("torchao.optim", "AdamW8bit"), ("torchao.prototype.low_bit_optim", "AdamW8bit")],
    "bitsandbytes AdamW8bit": [("bitsandbytes.optim", "AdamW8bit")],
}


def moment(values: torch.Tensor, dtype, signed: bool):
    """A moment holding ``values`` in the format ``dtype`` names (a float dtype, "8bit", "4bit")."""
    if not isinstance(dtype, str):
        return values.to(dtype)
    from shardamp.optim import state_formats
    from shardamp.optim.kernels.quant import QuantizedShard

    shard = QuantizedShard.zeros(state_formats.resolve("exp_avg_dtype", dtype, torch.float32), signed,
                                 values.numel(), 0, values.device)
    shard.store(values)
    return shard


def _optimizer_class(name: str) -> Tuple[Optional[type], str]:
    reasons = []
    for module, attr in PEERS[name]:
        try:
            mod = __import__(module, fromlist=[attr])
            return getattr(mod, attr), ""
        except Exception as exc:  # not installed, or built for another torch / CUDA
            reasons.append(f"{module}.{attr}: {type(exc).__name__}: {exc}")
    return None, "; ".join(reasons)


def peer_variants(sizes: List[int], device: torch.device, make_grads: Callable, max_norm: float,
                  wanted: Callable[[str], bool]) -> Dict[str, Tuple[Callable[[], None], Callable[[], None]]]:
    """``{row name: (prep, body)}`` for each importable peer (printing why the others are not)."""
    out = {}
    for name in PEERS:
        if not wanted(name):
            continue
        cls, why = _optimizer_class(name)
        if cls is None:
            print(f"{name}: skipped ({why})")
            continue
        params = [torch.nn.Parameter(torch.randn(n, device=device).to(torch.bfloat16)) for n in sizes]
        saved = make_grads(sizes, torch.bfloat16, device, seed=1)
        for p, g in zip(params, saved):
            p.grad = g.clone()
        try:
            opt = cls(params, lr=1e-3, weight_decay=0.01)
        except Exception as exc:
            print(f"{name}: skipped ({type(exc).__name__}: {exc})")
            continue
        grads = [p.grad for p in params]

        def prep(grads=grads, saved=saved):
            torch._foreach_copy_(grads, saved)

        def body(params=params, opt=opt):
            torch.nn.utils.clip_grad_norm_(params, max_norm)
            opt.step()

        out[name] = (prep, body)
    return out
