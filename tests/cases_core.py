"""Core parity cases, run inside one spawned gloo group per world size (see test_core.py)."""
from __future__ import annotations

import torch

from parity import train

TINY = 0.0004  # MB: about 100 fp32 elements, so params straddle buckets and shards


def case_basic(rank, world, **kw):
    return train(rank, world, **kw)


def case_one_group_big_bucket(rank, world, **kw):
    return train(rank, world, **kw, groups=False, opt_kwargs=dict(lr=1e-2, weight_decay=0.02, bucket_cap_mb=1000.0))


def case_tiny_buckets(rank, world, **kw):
    return train(rank, world, **kw, opt_kwargs=dict(bucket_cap_mb=TINY))


def case_adam_l2(rank, world, **kw):
    return train(rank, world, **kw, opt_kwargs=dict(adam_w_mode=False, weight_decay=0.05, bucket_cap_mb=TINY))


def case_lr_schedule(rank, world, **kw):
    return train(rank, world, **kw, lr_schedule=lambda step: 1e-2 / (1 + step))


def case_lr_schedule_shared(rank, world, **kw):
    # every group the same lr each step (a scheduler over groups with one base lr): one fill
    return train(rank, world, **kw, lr_schedule=lambda step: [1e-2 / (1 + step)] * 2)


# the groups' lrs shared, then apart, unchanged, shared again, one of them 0, an int: each way the
# step writes only the lrs, and back
_MIXED_LRS = [[1e-2, 1e-2], [2e-3, 5e-3], [2e-3, 5e-3], [4e-3, 4e-3], [0.0, 3e-3], [1, 1]]


def case_lr_schedule_mixed(rank, world, **kw):
    return train(rank, world, **kw, opt_kwargs=dict(bucket_cap_mb=TINY), lr_schedule=lambda step: _MIXED_LRS[step])


def case_no_sync(rank, world, **kw):
    return train(rank, world, **kw, micro_batches=3, opt_kwargs=dict(bucket_cap_mb=TINY))


def case_unused_everywhere(rank, world, **kw):
    return train(rank, world, **kw, skip=lambda step, r: ("b",) if step in (1, 2) else ())


def case_unused_per_rank(rank, world, **kw):
    # rank 0 never uses b; other ranks alternate: different buckets fill on different ranks
    def skip(step, r):
        if r == 0:
            return ("b",)
        return ("c",) if (step + r) % 2 else ()

    return train(rank, world, **kw, skip=skip, opt_kwargs=dict(bucket_cap_mb=TINY))


def case_channels_last(rank, world, **kw):
    return train(rank, world, **kw, kind="conv", channels_last=True, opt_kwargs=dict(bucket_cap_mb=TINY))


def case_channels_last_3d(rank, world, **kw):
    return train(rank, world, **kw, kind="conv3d", channels_last=True, opt_kwargs=dict(bucket_cap_mb=TINY))


def case_tied_weight_overlap_param_sync(rank, world, **kw):
    # the tied weight is read by a second module whose forward pre-hook must wait for it
    return train(rank, world, **kw, kind="tied", opt_kwargs=dict(overlap_param_sync=True, bucket_cap_mb=TINY))


def case_root_reads_child_weight_attached(rank, world, **kw):
    # a weight read in the root's forward body, outside its module's forward: opt.attach guards it
    return train(rank, world, **kw, kind="rootreads", attach=True,
                 opt_kwargs=dict(overlap_param_sync=True, bucket_cap_mb=TINY))


def case_bf16_params(rank, world, **kw):
    return train(rank, world, **kw, param_dtype=torch.bfloat16, opt_kwargs=dict(grad_sync_dtype=torch.float32))


def case_fp16_params(rank, world, **kw):
    # fp16 twin of case_bf16_params: fp16 model, fp32 master and fp32 grad reduction; the params
    # all-gathered in fp16 must equal the rounded master bit for bit (check_parity_case)
    return train(rank, world, **kw, param_dtype=torch.float16, opt_kwargs=dict(grad_sync_dtype=torch.float32))


def case_param_sync_bf16(rank, world, **kw):
    # fp32 params all-gathered in bf16: other ranks' shards arrive rounded, the masters stay exact
    return train(rank, world, **kw, shadow_ref=True, opt_kwargs=dict(param_sync_dtype=torch.bfloat16))


def case_sub_process_groups(rank, world, **kw):
    # two independent optimizers, each sharded over its own half of the ranks
    return train(rank, world, **kw, subgroups=2 if world % 2 == 0 else 1, opt_kwargs=dict(bucket_cap_mb=TINY))


def case_capturable_buffers(rank, world, **kw):
    # capturable=True keeps every full-size bucket buffer (static addresses) and zeroes it per round
    return train(rank, world, **kw, micro_batches=2, opt_kwargs=dict(capturable=True, bucket_cap_mb=TINY))


def case_sum_grads(rank, world, **kw):
    return train(rank, world, **kw, sum_grads=True, opt_kwargs=dict(average_grad_sync=False, lr=1e-3))


def case_no_overlap(rank, world, **kw):
    """Nothing overlapped: grads reduced at step (grad_sync), params gathered inside step."""
    return train(rank, world, **kw, opt_kwargs=dict(overlap_grad_sync=False, overlap_param_sync=False, bucket_cap_mb=TINY))


def case_param_overlap_only(rank, world, **kw):
    """Grads reduced at step, but the params' all-gather left in flight into the next forward."""
    return train(rank, world, **kw, opt_kwargs=dict(overlap_grad_sync=False, overlap_param_sync=True, bucket_cap_mb=TINY))




def case_grad_memory_bounded(rank, world, **kw):
    """ZeRO-2 memory: after backward, at most MAX_IN_FLIGHT full-size bucket buffers are alive
    (not one per bucket, which would be a whole unsharded grad copy)."""
    from shardamp.optim import DistributedFusedAdam
    from shardamp.optim.sync.reductions import MAX_IN_FLIGHT

    device = kw.get("device", "cpu")
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(32, 32) for _ in range(8)]).to(device)
    opt = DistributedFusedAdam(model.parameters(), bucket_cap_mb=0.005)
    model(torch.randn(4, 32, device=device)).sum().backward()
    gs = opt._grad_sync
    held = len(gs.reductions.held_inputs()) + sum(s.full is not None for s in gs.states)
    return {"buckets": len(opt._buckets), "held": held, "limit": MAX_IN_FLIGHT if world > 1 else len(opt._buckets)}




def case_memory_stats(rank, world, **kw):
    """memory_stats(): fp32 model -> no separate master, moments 8 B/param/world, grad shards
    4 B/param/world (plus padding); after the step no full-size bucket is alive."""
    from shardamp.optim import DistributedFusedAdam

    device = kw.get("device", "cpu")
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(4)]).to(device)
    opt = DistributedFusedAdam(model.parameters(), bucket_cap_mb=0.02)
    model(torch.randn(2, 64, device=device)).sum().backward()
    opt.step()
    n = sum(p.numel() for p in model.parameters())
    return {"n": n, "stats": opt.memory_stats()}


def case_channels_last_one_bucket_micro(rank, world, **kw):
    # every param staged into one bucket and landed with multi-tensor copies, then accumulated
    # (adds) over micro-batches under no_sync
    return train(rank, world, **kw, kind="conv", channels_last=True, micro_batches=2,
                 opt_kwargs=dict(bucket_cap_mb=1000.0))


def case_grad_staging_and_release(rank, world, **kw):
    """Staged (taken, not yet landed) grads stay under each bucket's flush_bytes during backward;
    at world 1 the grad buffer exists only between backward and zero_grad (unless capturable)."""
    from shardamp.optim import DistributedFusedAdam

    device = kw.get("device", "cpu")
    torch.manual_seed(0)
    out = {}
    for capturable in (False, True):
        model = torch.nn.Sequential(*[torch.nn.Linear(32, 32) for _ in range(6)]).to(device)
        opt = DistributedFusedAdam(model.parameters(), bucket_cap_mb=0.008, capturable=capturable)
        gs = opt._grad_sync
        worst = []

        def watch(_p, gs=gs, worst=worst):  # sees the staging after the previous grad (a native hook runs after it)
            worst.append(max(gs.stager.staged_bytes(s.index) - s.flush_bytes for s in gs.states))

        handles = [p.register_post_accumulate_grad_hook(watch) for p in model.parameters()]
        grads = []
        for _ in range(2):
            opt.zero_grad()
            after_zero = opt.memory_stats()["grad_shards"]
            model(torch.randn(4, 32, device=device)).sum().backward()
            after_backward = opt.memory_stats()["grad_shards"]
            opt.step()
            grads.append((after_zero, after_backward))
        out[f"capturable={capturable}"] = {"grad_shards": grads, "max_over_cap": max(worst),
                                          "buckets": len(opt._buckets)}
        # one live optimizer per process group: the next one is built over the same group (a hook
        # held by autograd keeps gs, and through it the optimizer, alive until removed)
        for h in handles:
            h.remove()
        del opt, gs, watch
    return out


def case_bf16_moments(rank, world, **kw):
    # bf16 exp_avg / exp_avg_sq against fp32 torch.optim.AdamW: close, not round-off (test_core)
    return train(rank, world, **kw, steps=10, opt_kwargs=dict(
        exp_avg_dtype=torch.bfloat16, exp_avg_sq_dtype=torch.bfloat16, bucket_cap_mb=TINY))


def case_bf16_exp_avg_sq_only(rank, world, **kw):
    return train(rank, world, **kw, steps=10, opt_kwargs=dict(exp_avg_sq_dtype=torch.bfloat16, weight_decay=0.02))


def case_bf16_params_remainders(rank, world, **kw):
    # the fp32 master kept as bf16 param + int16 remainder: the masters match torch's AdamW fed the
    # same grads to round-off, and the bf16 model is the master's high half (check_parity_case)
    return train(rank, world, **kw, param_dtype=torch.bfloat16,
                 opt_kwargs=dict(grad_sync_dtype=torch.float32, store_param_remainders=True, bucket_cap_mb=TINY))


def case_remainders_bitwise(rank, world, steps=40, **kw):
    """Remainders vs a separate fp32 master, many steps, fp32 and bf16 moments: the same grads
    (a linear loss sum(p * G_t), G_t drawn per rank and step, so the grads do not depend on the
    params) must give bit-identical masters, moments and step counts, and every bf16 param must
    be its master's high half. Two param groups, tiny buckets (uneven shards), an inf on the
    last rank only at step 7 (every rank skips), a param unused on rank 0 at even steps."""
    from shardamp.optim import DistributedFusedAdam
    from shardamp.optim.kernels.reference import split_remainders

    from parity import _masters

    device = kw.get("device", "cpu")
    shapes = [(7, 13), (13,), (5, 3, 3), (1,), (31,), (4, 9)]
    out = {}
    for moments in (torch.float32, torch.bfloat16):
        runs = []
        for remainders in (False, True):
            torch.manual_seed(0)
            params = [torch.nn.Parameter(torch.randn(s, device=device).bfloat16()) for s in shapes]
            groups = [{"params": params[:3]}, {"params": params[3:], "lr": 3e-2, "weight_decay": 0.0,
                                                "betas": (0.8, 0.95)}]
            opt = DistributedFusedAdam(groups, lr=1e-2, weight_decay=0.1, bucket_cap_mb=TINY,
                                       exp_avg_dtype=moments, exp_avg_sq_dtype=moments,
                                       store_param_remainders=remainders)
            for step in range(steps):
                g = torch.Generator().manual_seed(1000 * step + rank)
                loss = 0.0
                for i, p in enumerate(params):
                    if i == 4 and rank == 0 and step % 2 == 0:
                        continue
                    w = torch.randn(p.shape, generator=g).to(device)
                    if step == 7 and rank == world - 1 and i == 2:
                        w[0] = float("inf")
                    loss = loss + (p.float() * w).sum()
                loss.backward()
                opt.step()
                opt.zero_grad()
            # what is compared, kept; the optimizer itself is dropped before the next one is built
            # over the same group (one live optimizer per process group)
            runs.append({"masters": [m.clone() for m in _masters(opt)],
                         "moments": [(b.exp_avg.clone(), b.exp_avg_sq.clone()) for b in opt._buffers],
                         "steps": opt._steps.clone(), "params": params})
            del opt
        a, b = runs
        out[str(moments)] = {
            "masters_equal": all(torch.equal(x.view(torch.int32), y.view(torch.int32))
                                 for x, y in zip(a["masters"], b["masters"])),
            "moments_equal": all(torch.equal(x[0], y[0]) and torch.equal(x[1], y[1])
                                 for x, y in zip(a["moments"], b["moments"])),
            "steps_equal": torch.equal(a["steps"], b["steps"]), "steps": b["steps"].tolist(),
            "params_are_high_halves": all(torch.equal(p.view(torch.int16), split_remainders(m)[0].view(torch.int16))
                                          for p, m in zip(b["params"], b["masters"])),
        }
    return out


# blockwise moments ("8bit" / "4bit") against the same quantized math unsharded (parity.train
# picks tests/low_bit_reference.py for them): torch's parity tolerance holds
Q8 = dict(exp_avg_dtype="8bit", exp_avg_sq_dtype="8bit")
Q8_Q4 = dict(exp_avg_dtype="8bit", exp_avg_sq_dtype="4bit")
Q4 = dict(exp_avg_dtype="4bit", exp_avg_sq_dtype="4bit")


def case_low_bit_no_sync(rank, world, **kw):
    return train(rank, world, **kw, micro_batches=3, opt_kwargs=dict(bucket_cap_mb=TINY, **Q8))


def case_low_bit_unused_per_rank(rank, world, **kw):
    def skip(step, r):  # as case_unused_per_rank: b never on rank 0, c on alternate steps elsewhere
        if r == 0:
            return ("b",)
        return ("c",) if (step + r) % 2 else ()

    return train(rank, world, **kw, skip=skip, opt_kwargs=dict(bucket_cap_mb=TINY, **Q8_Q4))


def case_low_bit_channels_last(rank, world, **kw):
    return train(rank, world, **kw, kind="conv", channels_last=True,
                 opt_kwargs=dict(bucket_cap_mb=TINY, quant_block_size=32, **Q4))


def case_low_bit_capturable(rank, world, **kw):
    return train(rank, world, **kw, micro_batches=2, opt_kwargs=dict(capturable=True, bucket_cap_mb=TINY, **Q8_Q4))


def case_low_bit_bf16_params_remainders(rank, world, **kw):
    return train(rank, world, **kw, param_dtype=torch.bfloat16,
                 opt_kwargs=dict(grad_sync_dtype=torch.float32, store_param_remainders=True, bucket_cap_mb=TINY, **Q8))


def case_memory_stats_dtypes(rank, world, **kw):
    """memory_stats() per rank for each storage option over the same bf16 model: bytes per
    element of this rank's shards (padding included, so the ratios are exact)."""
    from shardamp.optim import DistributedFusedAdam

    device = kw.get("device", "cpu")
    out = {}
    bf16 = dict(exp_avg_dtype=torch.bfloat16, exp_avg_sq_dtype=torch.bfloat16)
    for name, opts in (("fp32", {}), ("bf16_moments", bf16),
                       ("remainders", dict(store_param_remainders=True)),
                       ("both", dict(store_param_remainders=True, **bf16))):
        torch.manual_seed(0)
        model = torch.nn.Sequential(*[torch.nn.Linear(48, 48) for _ in range(3)]).to(device).bfloat16()
        opt = DistributedFusedAdam(model.parameters(), bucket_cap_mb=0.01, **opts)
        model(torch.randn(2, 48, device=device).bfloat16()).float().sum().backward()
        opt.step()
        out[name] = {"stats": opt.memory_stats(), "shard": sum(b.shard_numel for b in opt._buckets),
                     "n": sum(p.numel() for p in model.parameters())}
        del opt  # one live optimizer per process group
    return out


def case_memory_stats_low_bit(rank, world, **kw):
    """memory_stats() per rank with blockwise moments over a bf16 model with remainders and bf16
    grads (the lightest state): bytes per element of this rank's shards."""
    from shardamp.optim import DistributedFusedAdam

    out = {}
    for name, fmt in (("8bit", Q8), ("4bit", Q4), ("8bit_4bit", Q8_Q4)):
        torch.manual_seed(0)
        model = torch.nn.Sequential(*[torch.nn.Linear(48, 48) for _ in range(3)]).bfloat16()
        opt = DistributedFusedAdam(model.parameters(), bucket_cap_mb=0.01, store_param_remainders=True, **fmt)
        model(torch.randn(2, 48).bfloat16()).float().sum().backward()
        opt.step()
        out[name] = {"stats": opt.memory_stats(), "shard": sum(b.shard_numel for b in opt._buckets)}
        del opt  # one live optimizer per process group
    return out


class _HeldBound:
    """``kernels.held_bucket_params`` answering ``bound`` (the CUDA kernels' HELD_SEGMENTS), so
    the CPU ranks lay buckets out as one CUDA process does."""

    def __init__(self, bound: int) -> None:
        self.bound = bound

    def __enter__(self) -> None:
        from shardamp.optim import kernels
        from shardamp.optim.sync import merged_landings

        self.saved = kernels.held_bucket_params, merged_landings.HELD_CUT_BYTES
        kernels.held_bucket_params = lambda device: self.bound
        merged_landings.HELD_CUT_BYTES = 0  # the tiny test models' buckets are cut too

    def __exit__(self, *exc) -> None:
        from shardamp.optim import kernels
        from shardamp.optim.sync import merged_landings

        kernels.held_bucket_params, merged_landings.HELD_CUT_BYTES = self.saved


def case_held_bucket_bound(rank, world, **kw):
    """One process cuts buckets at the grads its launches read in place (here 2 a bucket, in one
    big-capped bucket's place); more ranks do not. Trains as torch either way."""
    with _HeldBound(2):
        return train(rank, world, **kw, opt_kwargs=dict(bucket_cap_mb=1000.0))


def case_held_bucket_layout(rank, world, **kw):
    """The bucket sizes (params a bucket) the bound gives: cut at one process unless capturable,
    offloaded, with a blockwise moment, without overlap or with grads in another dtype than the
    params' (nothing is held then); never at more ranks."""
    from shardamp.optim import DistributedFusedAdam

    out = {}
    with _HeldBound(2):
        for name, opts in (("default", {}), ("capturable", dict(capturable=True)), ("offload", dict(offload="cpu")),
                           ("8bit", Q8), ("no_overlap", dict(overlap_grad_sync=False)),
                           ("bf16_grads", dict(grad_sync_dtype=torch.bfloat16))):
            torch.manual_seed(0)
            model = torch.nn.Sequential(*[torch.nn.Linear(32, 32) for _ in range(3)])
            opt = DistributedFusedAdam(model.parameters(), bucket_cap_mb=1000.0, **opts)
            out[name] = [len(b.slots) for b in opt._buckets]
            del opt  # one live optimizer per process group
    return out


CASES = [name for name in dir() if name.startswith("case_")]
# cases that check bookkeeping (memory, staging), not parity with torch
NOT_PARITY = ("case_grad_memory_bounded", "case_memory_stats", "case_grad_staging_and_release",
              "case_memory_stats_dtypes", "case_memory_stats_low_bit", "case_remainders_bitwise", "case_bf16_moments",
              "case_bf16_exp_avg_sq_only", "case_held_bucket_layout")
