"""What the blockwise kernel tests (test_quant_step.py on the CPU, test_cuda_low_bit.py on a GPU)
share: a synthetic shard of one state kind (segments of several groups with padding between them,
an untouched param, a partial last block, a nonzero block offset; moments that already hold
values over many decades) and its steps run through the dispatcher (the compiled kernel) and
through the reference, the results compared."""
from __future__ import annotations

import itertools
from typing import Dict, List, Optional, Tuple

import torch

from shardamp.optim import kernels, state_formats as sf
from shardamp.optim.kernels import quant, reference
from shardamp.optim.layout import Segment, SegmentTable

MOMENT_FORMATS = [sf.FP32, sf.BF16, sf.Q8, sf.Q4]
# every pair with at least one blockwise moment
MOMENT_PAIRS = [(a, b) for a, b in itertools.product(MOMENT_FORMATS, MOMENT_FORMATS) if a.blockwise or b.blockwise]
# the master: fp32 alone, fp32 with a bf16 / fp16 model copy, or int16 remainders under bf16 params
MASTERS = ["fp32", "fp32+bf16", "fp32+fp16", "remainders"]
GRAD_DTYPES = [torch.float32, torch.bfloat16, torch.float16]

NUMEL = 967  # odd: a partial last block of every block size, a half-used last byte of 4-bit codes
OFFSET = 1024  # the shard's first element in its bucket (a nonzero block offset)
# (start, length, param_index, group): padding between segments, segments crossing blocks,
# param 3 untouched, the last segment ending the shard
ROWS = [(0, 7, 0, 0), (16, 33, 1, 1), (64, 300, 2, 0), (368, 129, 3, 2), (512, 200, 4, 1), (720, 247, 5, 2)]
HPARAMS = [[1e-2, 0.9, 0.999, 1e-8, 0.1], [3e-3, 0.8, 0.95, 1e-6, 0.0], [2e-2, 0.6, 0.99, 1e-8, 0.01]]
STEPS0 = [3.0, 1.0, 5.0, 2.0, 7.0, 0.0]
UNTOUCHED = 3


def segments(device: torch.device) -> SegmentTable:
    return SegmentTable.build([Segment(s, n, p, g, 0) for s, n, p, g in ROWS], device)


def _values(n: int, signed: bool, gen: torch.Generator) -> torch.Tensor:
    mags = 10.0 ** (torch.rand(n, generator=gen) * 8 - 9)  # 8 decades inside every block
    return mags * torch.where(torch.rand(n, generator=gen) < 0.5, -1.0, 1.0) if signed else mags


def moment(fmt: sf.StateFormat, signed: bool, gen: torch.Generator, device: torch.device):
    """A moment in ``fmt`` already holding values (blockwise: their codes and scales)."""
    x = _values(NUMEL, signed, gen)
    if not fmt.blockwise:
        return x.to(fmt.storage_dtype).to(device)
    qmap, block = quant.format_map(fmt, signed)
    codes, scales = quant.quantize_packed(x, qmap, fmt.bits, block, OFFSET)
    return quant.QuantizedShard(fmt, signed, NUMEL, OFFSET, codes.to(device), scales.to(device))


def to(state, device: torch.device):
    """A copy of one state tensor (or blockwise moment) on ``device``."""
    if isinstance(state, quant.QuantizedShard):
        return quant.QuantizedShard(state.fmt, state.signed, state.numel, state.offset, state.codes.to(device),
                                    state.scales.to(device))
    return None if state is None else state.to(device)


def clone(state):
    if isinstance(state, quant.QuantizedShard):
        return quant.QuantizedShard(state.fmt, state.signed, state.numel, state.offset, state.codes.clone(),
                                    state.scales.clone())
    return None if state is None else state.clone()


def flat(state) -> List[torch.Tensor]:
    """The stored tensors of a state (codes and scales of a blockwise one)."""
    if isinstance(state, quant.QuantizedShard):
        return [state.codes, state.scales]
    return [] if state is None else [state]


def make_state(pair: Tuple[sf.StateFormat, sf.StateFormat], master_kind: str, seed: int,
               device: torch.device) -> Dict[str, object]:
    gen = torch.Generator().manual_seed(seed)
    p = torch.randn(NUMEL, generator=gen)
    if master_kind == "remainders":
        hi, lo = reference.split_remainders(p)
        master, out = lo.to(device), hi.to(device)
    else:
        master = p.to(device)
        out = {"fp32": None, "fp32+bf16": torch.bfloat16, "fp32+fp16": torch.float16}[master_kind]
        out = None if out is None else p.to(out).to(device)
    return {"master": master, "out": out, "m": moment(pair[0], True, gen, device),
            "v": moment(pair[1], False, gen, device)}


def grads(n_steps: int, dtype: torch.dtype, seed: int, device: torch.device) -> List[torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 + seed)
    out = []
    for _ in range(n_steps):
        g = torch.randn(NUMEL, generator=gen) * 10.0 ** (torch.rand(NUMEL, generator=gen) * 6 - 4)
        g[::11] = 0.0
        out.append(g.to(dtype).to(device))
    return out


def run(state: Dict[str, object], grad_list: List[torch.Tensor], adam_w: bool, native: bool,
        found_inf_at: Tuple[int, ...] = (1,), coef: float = 0.37, steps_done: int = 0) -> Dict[str, object]:
    """The state after one step per grad (``found_inf`` set on the steps of ``found_inf_at``):
    through the dispatcher (``native``) or the reference, on a copy of ``state`` (on its device;
    ``steps_done``: steps the touched params took before)."""
    st = {k: clone(v) for k, v in state.items()}
    device = st["master"].device
    table = segments(device)
    host_rows = torch.tensor(ROWS, dtype=torch.int64)
    hp = torch.tensor(HPARAMS, dtype=torch.float64, device=device)
    touched = torch.ones(len(STEPS0), device=device)
    touched[UNTOUCHED] = 0
    steps = torch.tensor(STEPS0, device=device) + touched * steps_done
    grad_coef = torch.tensor(coef, device=device)
    for k, g in enumerate(grad_list):
        found = torch.tensor(1.0 if k in found_inf_at else 0.0, device=device)
        steps += touched * (1 - found)
        args = (st["master"], st["m"], st["v"], st["out"])
        if native:
            kernels.adam_step(g, *args[:3], args[3], table, hp, steps, touched, grad_coef, found, adam_w, True)
        else:
            reference.adam_step(g, *args[:3], args[3], host_rows, hp, steps, touched, grad_coef, found, adam_w, True)
    return st


def differences(a: Dict[str, object], b: Dict[str, object]) -> List[str]:
    """The state keys whose stored tensors differ in any bit."""
    bad = []
    for key in a:
        for x, y in zip(flat(a[key]), flat(b[key])):
            if not torch.equal(x.view(torch.uint8) if x.is_floating_point() else x,
                               y.view(torch.uint8) if y.is_floating_point() else y):
                bad.append(key)
    return bad


def code_steps(a: quant.QuantizedShard, b: quant.QuantizedShard) -> int:
    """The largest difference in code index between two blockwise moments, element by element."""
    ca = quant.unpack4(a.codes, a.numel) if a.fmt.bits == 4 else a.codes
    cb = quant.unpack4(b.codes, b.numel) if b.fmt.bits == 4 else b.codes
    return int((ca.int() - cb.int()).abs().max())


def param_values(state: Dict[str, object]) -> torch.Tensor:
    """The fp32 master values (joined from remainders)."""
    if state["master"].dtype == torch.int16:
        return reference.join_remainders(state["out"], state["master"])
    return state["master"]


def case_id(pair, master_kind: Optional[str] = None) -> str:
    return "-".join(f.name for f in pair) + (f"-{master_kind}" if master_kind else "")
